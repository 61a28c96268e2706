"""The worker's outside: `gcache-worker` flags (flags), the HTTP server (server), OpenAI
completions over the engine (completions), and the Redis publisher for gcache-router
(publisher)."""
