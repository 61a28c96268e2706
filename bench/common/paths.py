"""Where the benches find the repository and the shared traces."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRACE_DIR = REPO.parent / "shared/data/traces"  # Mooncake-format traces, beside the checkout
CONVERSATION_TRACE = TRACE_DIR / "conversation_trace.jsonl"
