"""The GPU check: its preparation here (prepare.sh), its run on a bare GPU machine (gpu_check.sh,
check.py), and a cupy made of host memory for its dry run and the tests (host_cupy.py)."""
