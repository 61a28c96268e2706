"""What moves KV bytes between vLLM's blocks and host memory (base.BlockMover: host, stand-in, CUDA)."""
