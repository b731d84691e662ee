#!/usr/bin/env bash
# Runs every test, C++ (GoogleTest via ctest) and Python (pytest, multi-process
# on CPU over gloo), after installing what is missing and building. GPU tests
# skip without CUDA. Extra arguments go to pytest.
FLATSHARD_BUILD_TESTS=ON
source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh"

echo "== C++ tests"
ctest --test-dir build/release --output-on-failure

echo "== Python tests"
start=$(date +%s)
"$PY" -m pytest tests -q "$@"
echo "== Python tests took $(( $(date +%s) - start ))s"
