#!/usr/bin/env bash
# Everything a session with the lent GPU machine runs, in one call (device
# time is scarce; see benchmarks/RESULTS.md, section "GPU"). From the repo root:
#   FLATSHARD_COMMIT=<hash> bash scripts/gpu_session.sh [tests|bench|all]
# writes logs and results under $OUT (or ./gpu-out). The checkout arrives there
# without .git: put the commit in FLATSHARD_COMMIT (`git rev-parse HEAD` here).
# `tests` and `bench` split the work over two calls if one would pass the
# device's 10-minute limit (results are copied back only when the bench ends).
# That machine has torch with CUDA and the Python tools but no network and no
# GoogleTest, so the C++ tests (CPU logic, run by CI) are left out there. Runs:
# the build, the GPU tests, the whole Python suite, then the benchmarks (NCCL at
# world size 1). Each step's log is kept; a failing step does not stop the next.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TORCH_NCCL_AVOID_RECORD_STREAMS=1 FLATSHARD_CPP_TESTS=0
# The machine's CXX (/opt/gcc/bin/g++) links libstdc++ statically, which CMakeLists.txt refuses (see [Note: One
# libstdc++ with torch]); a build directory configured with it keeps it in its cache, so it goes first.
export CXX=/usr/bin/c++ CC=/usr/bin/cc
rm -rf build/cp312-cp312-linux_x86_64
# Quick path, as run on 2026-11-28 (no network there: scripts/test.sh would try to install the frameworks):
#   python3 -m pip install --no-build-isolation --no-deps -q .
#   python3 -m pytest tests/test_gpu.py tests/test_gpu_overlap.py tests/test_gpu_memory.py -m gpu -q -rA
#   python3 benchmarks/run.py --device cuda --workloads gpt-large-bf16,gpt-large --no-publish --out /tmp/b
# Next time also: fully_shard's small units gathered together through NCCL's grouped all-gather (off by default on
# GPU meshes until this passes; [Note: fully_shard gathers small units together] in _fsdp2_config.py):
#   FLATSHARD_GATHER_TOGETHER_BYTES=262144 python3 -m pytest tests/test_gpu.py -m gpu -q -rA -k fully_shard
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  echo "commit ${FLATSHARD_COMMIT:-unknown (set FLATSHARD_COMMIT)}"; date -u; } >"$out/device.txt" 2>&1
what=${1:-all}
rc=0
if [[ "$what" == all || "$what" == tests ]]; then
  # The GPU tests' traces and memory snapshots go into one archive (at most 8 files come back).
  export FLATSHARD_TEST_ARTIFACTS=/tmp/flatshard-artifacts
  mkdir -p "$FLATSHARD_TEST_ARTIFACTS"
  bash scripts/test.sh -m gpu -rA 2>&1 | tee "$out/test_gpu.log" || rc=1
  tar czf "$out/test_artifacts.tgz" -C /tmp flatshard-artifacts
  FLATSHARD_GATHER_TOGETHER_BYTES=262144 python3 -m pytest tests/test_gpu.py -m gpu -q -rA -k fully_shard 2>&1 |
    tee "$out/test_gpu_gathered_together.log" || rc=1
  python3 -m pytest tests -q -m "not gpu" 2>&1 | tee "$out/test_all.log" || rc=1
fi
if [[ "$what" == all || "$what" == bench ]]; then
  # --no-publish: RESULTS.md's GPU section is written by hand from these files.
  bash scripts/run_benchmarks.sh --no-publish --out /tmp/flatshard-bench 2>&1 | tee "$out/bench.log" || rc=1
  for f in results.json table.md step_time.png; do  # the device returns at most 8 files
    cp /tmp/flatshard-bench/$f "$out/" 2>/dev/null || echo "no $f" >>"$out/bench.log"
  done
fi
exit $rc
