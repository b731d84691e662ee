#!/usr/bin/env bash
# Runs every test, C++ (GoogleTest via ctest) and Python (pytest, multi-process
# on CPU over gloo), after installing what is missing and building. GPU tests
# skip without CUDA. Extra arguments go to pytest. FLATSHARD_CPP_TESTS=0 builds
# and runs no C++ tests (for a machine without GoogleTest or network; says so).
if [[ "${FLATSHARD_CPP_TESTS:-1}" == 0 ]]; then FLATSHARD_BUILD_TESTS=OFF; else FLATSHARD_BUILD_TESTS=ON; fi
FLATSHARD_NEEDS_TEST_DEPS=1
source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh"

if [[ "$FLATSHARD_BUILD_TESTS" == ON ]]; then
  echo "== C++ tests"
  ctest --test-dir build/release --output-on-failure
else
  echo "== C++ tests NOT built or run (FLATSHARD_CPP_TESTS=0)"
fi

# [Note: Two test processes]
# A test's ranks rarely keep both cores busy: a W = 1 case or a fresh interpreter's imports use one, ranks wait on
# each other's collectives, the pytest process waits on its ranks (a third of the machine's CPU time sat idle in
# one process). pytest-xdist runs two pytest processes, a test file each at a time (--dist loadfile: a file's
# cases share one start of their ranks, see [Note: One process start per world size] in tests/_cases.py), each
# with its own fork server: about a fifth less time, the CPU busy throughout. The tests hold under that load as
# they do beside other jobs (their waits are for events, their deadlines generous). With a GPU the tests run in
# one process: two would share the device that the GPU tests measure. FLATSHARD_TEST_WORKERS=1 runs one anyway.
workers=${FLATSHARD_TEST_WORKERS:-2}
if [[ -z "${FLATSHARD_TEST_WORKERS:-}" ]] && nvidia-smi -L >/dev/null 2>&1; then workers=1; fi
parallel=() processes="one process"
if ((workers > 1)) && "$PY" -c "import xdist" 2>/dev/null; then
  parallel=(-n "$workers" --dist loadfile) processes="$workers processes"
fi

echo "== Python tests ($processes)"
start=$(date +%s)
# The slowest tests in every log: what to make leaner when the command nears its budget (README).
"$PY" -m pytest tests -q --durations=15 "${parallel[@]}" "$@"
echo "== Python tests took $(( $(date +%s) - start ))s"
