"""Device (GPU) arrays as put sources and get targets: parsing arrays and the copy backends
(arrays), and the pinned staging buffer the copies go through (staging)."""
