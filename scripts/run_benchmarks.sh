#!/usr/bin/env bash
# Runs the benchmarks (flatshard against torch FSDP2, FSDP1, DDP and local
# training) after installing what is missing and building; writes the table,
# JSON and plots to benchmarks/out/ and updates benchmarks/RESULTS.md.
# Extra arguments go to benchmarks/run.py (--quick, --profile, --workloads ...).
FLATSHARD_NEEDS_PLOTS=1
source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh"
echo "== benchmarks/run.py $*"
"$PY" benchmarks/run.py "$@"
