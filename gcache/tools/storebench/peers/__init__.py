"""One adapter per store; each runs the identical workloads in workloads.py."""
