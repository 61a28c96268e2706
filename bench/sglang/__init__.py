"""SGLang benches: GCache as SGLang's HiCache L3 backend (run in .venv-sglang)."""
