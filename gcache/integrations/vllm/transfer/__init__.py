"""Moving pages between vLLM's KV views and the store: the byte runs of a page, one value per
(page, group, rank), the staging pool, the save and load state machines, and the movers (host,
CUDA, the tests' stand-in device)."""
