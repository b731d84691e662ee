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

echo "== Python tests"
start=$(date +%s)
# The slowest tests in every log: what to make leaner when the command nears its budget (README).
"$PY" -m pytest tests -q --durations=15 "$@"
echo "== Python tests took $(( $(date +%s) - start ))s"
