"""GCache: a distributed L3 KV-cache store for LLM inference."""

__version__ = "0.1.0"
