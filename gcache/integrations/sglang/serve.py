"""SGLang's server with GCache registered as an embedding-store backend:

    GCACHE_SGLANG_EMBEDDING_CONFIG='{"gcache_url": "127.0.0.1:7600", "gcache_model": "qwen2.5-vl-7b"}' \\
    python -m gcache.integrations.sglang.serve --model-path /mnt/models/Qwen2.5-VL-7B-Instruct \\
        --encoder-only --enable-mm-global-cache --mm-global-cache-backend gcache ...

Every argument is SGLang's (`python -m sglang.launch_server`). Two things a one-line
`register()` in a script of one's own cannot do alone:

- SGLang's `--mm-global-cache-backend` accepts only "mooncake" (argparse choices); this adds
  "gcache" (embedding_store.allow_cli_choice);
- the encoder's TP ranks 1.. are *spawned* processes, which start from a fresh interpreter:
  they re-import this module (multiprocessing's spawn runs the parent's main module again, as
  `__mp_main__`), so the registration at the top of this file runs in each of them before
  their encoder builds its store. SGLang's own `__main__` is run without replacing this
  module as `__main__` for that reason.
"""

from __future__ import annotations

import runpy

from gcache.integrations.sglang.embedding_store import register

register()

if __name__ == "__main__":
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=False)
