#!/usr/bin/env bash
# Measures the issue's targets: one client process, a local gcache-server, Redis and
# Mooncake Store side by side, 64-key batches of 256 KiB values, 3 interleaved rounds
# (median, min and max of every figure and of every per-round ratio).
# Usage: bench/store/run_targets.sh [OUT.json]   (run from the repository root, as root for Mooncake)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-bench/targets.json}"
PY="${PYTHON:-.venv/bin/python}"
"$PY" -m gcache.tools.storebench.main \
  --memory 1GiB --disk 2GiB \
  --value-size 256KiB --batch 64 --threads 1 --duration 5s --repeat 3 \
  --exists-keys 10000 --latency-value-size 4KiB \
  --vs redis,mooncake --json > "$OUT"
"$PY" -c 'import json,sys; from gcache.tools.storebench.report import render_table; print(render_table(json.load(open(sys.argv[1]))))' "$OUT"
echo "JSON: $OUT"
