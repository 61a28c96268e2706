"""gcache-router: cache-affinity routing over workers that publish their state to Redis."""
