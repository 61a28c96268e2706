"""The KV connector itself: its two halves (scheduler side, worker side), what they tell each
other, the plan of which pages load and save, the KV cache groups, the keys, its settings and
counters."""
