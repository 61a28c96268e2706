"""The vLLM group's router tests' engines: the tiny chat model (now
gcache.testing.vllm_chat, shared with bench/router/vllm_trace.py; re-exported
here) and events_run, one engine with KV events on over given prompts.
"""

from __future__ import annotations

import json
from pathlib import Path

from gcache.testing.vllm_chat import (  # noqa: F401  (re-exported for the tests)
    BOS_ID,
    CHAT_TEMPLATE,
    EOS_ID,
    PAD_ID,
    SPECIALS,
    build_tokenizer,
    write_chat_model,
    write_tokenizer,
)


def events_run(kind: str, work, steps: list) -> dict:
    """One engine (in this process) of tiny model `kind` with KV events on, over `steps`: lists
    of prompts (token ids), each step generated in order. Returns, per step, the ZMQ messages
    its events came in (base64, in order) and each prompt's num_cached_tokens: what a router
    fed those events would credit, beside what the engine really hit. Run it in a process of
    its own (python -m tests.integrations.vllm.router_models events SPEC OUT)."""
    import base64
    import os
    import threading
    import time

    from gcache.testing.vllm_models import BLOCK_SIZE, engine_env, write_model

    work = Path(work)
    os.environ.update(engine_env(work))
    model = write_model(kind, work / kind)
    import zmq
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig
    from vllm.inputs import TokensPrompt

    endpoint = f"ipc://{work}/events.sock"
    frames: list = []
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    stop = threading.Event()

    def receive():
        while not stop.is_set():
            if sub.poll(50):
                frames.append(sub.recv_multipart())

    threading.Thread(target=receive, daemon=True).start()
    llm = LLM(
        model=str(model),
        load_format="auto",
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=2048,
        block_size=BLOCK_SIZE,
        seed=0,
        kv_cache_memory_bytes=16 << 20,
        distributed_executor_backend="uni",
        enable_prefix_caching=True,
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint),
    )
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = []
    for prompts in steps:
        cached = []
        for p in prompts:
            (r,) = llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)
            cached.append(int(r.num_cached_tokens or 0))
        time.sleep(0.5)  # the publisher thread sends the step's batch
        got, frames[:] = list(frames), []
        out.append({"cached": cached, "frames": [[base64.b64encode(bytes(x)).decode() for x in f] for f in got]})
    stop.set()
    return {"steps": out}


if __name__ == "__main__":
    import os
    import sys

    if sys.argv[1:2] == ["events"]:
        spec = json.loads(Path(sys.argv[2]).read_text())
        Path(sys.argv[3]).write_text(json.dumps(events_run(spec["kind"], spec["work"], spec["steps"])))
        sys.stdout.flush()
        os._exit(0)  # skip vLLM's slow teardown: the result is written
    raise SystemExit("usage: python -m tests.integrations.vllm.router_models events SPEC.json OUT.json")
