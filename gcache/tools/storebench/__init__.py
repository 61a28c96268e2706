"""gcache-bench: GCache throughput/latency side by side with Redis and Mooncake Store."""
