"""HTTP pieces shared by `gcache-worker` and `gcache-router` (aiohttp).

errors        HTTPError and the OpenAI error body
body          read a request body under a deadline and a size limit (before taking a slot)
safe_json     JSON parsing that answers 400 for what json.loads lets through or crashes on
limiter       in-flight limiter (503 when full, never a queue without bound)
counters      HTTP counters as Prometheus text; the middleware that counts and shapes errors
sse           server-sent-event framing
runner        run an aiohttp app on a socket with a large listen backlog
openai_api    OpenAI request parsing (completions and chat), the chat template, prompt_tokens()
openai_bodies OpenAI response bodies and stream chunks
stop_text     output text with stop strings (hold-back while streaming) and UTF-8 reassembly
tiers         the cache tiers by name (L1/L2/L3): what the worker reports, the router credits
"""
