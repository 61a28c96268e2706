"""The worker's engine: requests (request), the scheduler and its policies (scheduler), the
step loop (engine), the thread that owns it (engine_thread), and its counters (metrics)."""
