# Sourced by scripts/test.sh and scripts/run_example.sh: installs what a fresh
# machine lacks (torch 2.13 CPU if no torch, build and test tools), then builds
# and installs flatshard from this checkout. Set FLATSHARD_BUILD_TESTS=ON to
# also build the C++ tests.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}

if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "== installing torch 2.13.0 (CPU)"
  "$PY" -m pip install -q torch==2.13.0
fi
missing=()
"$PY" -c "import scikit_build_core" 2>/dev/null || missing+=("scikit-build-core>=0.10")
"$PY" -c "import pytest, pytest_timeout" 2>/dev/null || missing+=("pytest>=8" "pytest-timeout>=2.3")
# torch.distributed's *_object collectives (used by tests) need NumPy, which torch's wheel does not pull in.
"$PY" -c "import numpy" 2>/dev/null || missing+=("numpy")
if [[ "${FLATSHARD_NEEDS_TEST_DEPS:-0}" == 1 ]]; then
  # Real models in the tests: HF transformers built from configs (nothing downloaded at run time).
  "$PY" -c "import transformers" 2>/dev/null || missing+=("transformers>=4.40")
  # Frameworks whose own FSDP1 code the tests run on flatshard (tests/test_framework_*.py).
  "$PY" -c "import accelerate" 2>/dev/null || missing+=("accelerate>=1.0")
  "$PY" -c "import trl" 2>/dev/null || missing+=("trl>=0.20")
  "$PY" -c "import lightning" 2>/dev/null || missing+=("lightning>=2.2")
  "$PY" -c "import matplotlib" 2>/dev/null || missing+=("matplotlib")  # python -m flatshard.plan --plot
  # peft 0.21 finds LoRA entries by module names with only a leading _fsdp_wrapped_module removed: with
  # nested FSDP1 units (verl's LoRA wrapping) it finds none, on torch's FSDP1 as on flatshard.
  "$PY" -c "import peft, sys; sys.exit(tuple(map(int, peft.__version__.split('.')[:2])) >= (0, 21))" 2>/dev/null ||
    missing+=("peft>=0.10,<0.21")
  # verl is installed with --no-deps below; these are what verl.utils.fsdp_utils imports.
  "$PY" -c "import ray" 2>/dev/null || missing+=("ray")
  "$PY" -c "import tensordict" 2>/dev/null || missing+=("tensordict>=0.8,<=0.10")
  "$PY" -c "import omegaconf" 2>/dev/null || missing+=("omegaconf")
fi
if [[ "${FLATSHARD_NEEDS_PLOTS:-0}" == 1 ]]; then
  "$PY" -c "import matplotlib" 2>/dev/null || missing+=("matplotlib")
fi
"$PY" -c "import tqdm" 2>/dev/null || missing+=("tqdm>=4.60")
if ! cmake --version 2>/dev/null | awk 'NR==1{split($3,v,"."); exit !(v[1]>3 || (v[1]==3 && v[2]>=24))}'; then
  missing+=("cmake>=3.24")
fi
command -v ninja >/dev/null || missing+=("ninja")
if ((${#missing[@]})); then
  echo "== installing ${missing[*]}"
  "$PY" -m pip install -q "${missing[@]}"
fi
if [[ "${FLATSHARD_NEEDS_TEST_DEPS:-0}" == 1 ]] && ! "$PY" -c "import verl" 2>/dev/null; then
  echo "== installing verl (--no-deps: its FSDP utilities only)"
  "$PY" -m pip install -q --no-deps "verl>=0.5"
fi
if [[ "${FLATSHARD_BUILD_TESTS:-OFF}" == ON ]] && ! [[ -e /usr/include/gtest/gtest.h ]]; then
  echo "== installing GoogleTest (Debian libgtest-dev)"
  if [[ $(id -u) -eq 0 ]]; then SUDO=(); else SUDO=(sudo); fi
  if ! { "${SUDO[@]}" apt-get update -qq &&
         DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq libgtest-dev >/dev/null; }; then
    echo "error: GoogleTest is missing and could not be installed (Debian's libgtest-dev)." >&2
    echo "       Install it, or run the Python tests alone with FLATSHARD_CPP_TESTS=0." >&2
    exit 1
  fi
fi

# A compiler that links libstdc++ statically into shared libraries would give
# flatshard._C a second libstdc++ beside torch's (see [Note: One libstdc++ with
# torch] in CMakeLists.txt, which refuses it): fall back to the system's c++.
links_shared_libstdcxx() {
  local dir; dir=$(mktemp -d)
  printf '#include <sstream>\n#include <string>\nstd::string probe(long v) { std::ostringstream s; s << v; return s.str(); }\n' >"$dir/p.cpp"
  "$1" -shared -fPIC "$dir/p.cpp" -o "$dir/p.so" 2>/dev/null && grep -aq 'libstdc++\.so' "$dir/p.so"
  local rc=$?; rm -rf "$dir"; return $rc
}
if [[ -n "${CXX:-}" ]] && ! links_shared_libstdcxx "$CXX" && command -v c++ >/dev/null && links_shared_libstdcxx c++; then
  echo "== CXX=$CXX links libstdc++ statically into shared libraries; building with $(command -v c++) instead"
  export CXX=$(command -v c++) CC=$(command -v cc || echo cc)
fi

echo "== building flatshard (torch $("$PY" -c 'import torch; print(torch.__version__)'))"
start=$(date +%s)
# --no-build-isolation: build against the torch installed here, never download another.
"$PY" -m pip install -q --no-build-isolation --no-deps \
  -C cmake.define.FLATSHARD_BUILD_TESTS="${FLATSHARD_BUILD_TESTS:-OFF}" -C build-dir=build/release .
echo "== build took $(( $(date +%s) - start ))s"
