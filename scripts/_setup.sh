# Sourced by scripts/test.sh and scripts/run_example.sh: installs what a fresh
# machine lacks (torch 2.13 CPU if no torch, build and test tools), then builds
# and installs flatshard from this checkout. Set FLATSHARD_BUILD_TESTS=ON to
# also build the C++ tests.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}

# What is installed, read from the installed packages' metadata in one interpreter (importing each to see
# whether it is there costs about 40 s for the test dependencies). Prints "torch" if torch is missing, then
# the pip requirement of each other missing package.
installed_check() {
  "$PY" - "$@" <<'PYEOF'
import importlib.metadata as md
import sys

def version(name):
    try:
        return tuple(int(p) for p in md.version(name).split("+")[0].split(".")[:2] if p.isdigit())
    except md.PackageNotFoundError:
        return None

needs_test, needs_plots = sys.argv[1] == "1", sys.argv[2] == "1"
if version("torch") is None:
    print("torch")
wanted = [("scikit-build-core", "scikit-build-core>=0.10"), ("pytest", "pytest>=8"),
          ("pytest-timeout", "pytest-timeout>=2.3"), ("tqdm", "tqdm>=4.60"),
          # torch.distributed's *_object collectives (used by tests) need NumPy, which torch's wheel does not pull in.
          ("numpy", "numpy")]
if needs_test:
    wanted += [
        # Real models in the tests: HF transformers built from configs (nothing downloaded at run time).
        ("transformers", "transformers>=4.40"),
        # Frameworks whose own FSDP1 code the tests run on flatshard (tests/test_framework_*.py).
        ("accelerate", "accelerate>=1.0"), ("trl", "trl>=0.20"), ("lightning", "lightning>=2.2"),
        ("matplotlib", "matplotlib"),  # python -m flatshard.plan --plot
        # verl is installed with --no-deps (below); these are what verl.utils.fsdp_utils imports.
        ("ray", "ray"), ("tensordict", "tensordict>=0.8,<=0.10"), ("omegaconf", "omegaconf")]
if needs_plots:
    wanted.append(("matplotlib", "matplotlib"))
for name, requirement in dict(wanted).items():  # (one line per package)
    if version(name) is None:
        print(requirement)
# peft 0.21 finds LoRA entries by module names with only a leading _fsdp_wrapped_module removed: with nested
# FSDP1 units (verl's LoRA wrapping) it finds none, on torch's FSDP1 as on flatshard.
if needs_test and (version("peft") is None or version("peft") >= (0, 21)):
    print("peft>=0.10,<0.21")
PYEOF
}

missing=()
while IFS= read -r requirement; do
  [[ -n "$requirement" ]] && missing+=("$requirement")
done < <(installed_check "${FLATSHARD_NEEDS_TEST_DEPS:-0}" "${FLATSHARD_NEEDS_PLOTS:-0}")
if [[ "${missing[0]:-}" == torch ]]; then
  echo "== installing torch 2.13.0 (CPU)"
  "$PY" -m pip install -q torch==2.13.0
  missing=("${missing[@]:1}")
fi
if ! cmake --version 2>/dev/null | awk 'NR==1{split($3,v,"."); exit !(v[1]>3 || (v[1]==3 && v[2]>=24))}'; then
  missing+=("cmake>=3.24")
fi
command -v ninja >/dev/null || missing+=("ninja")
if ((${#missing[@]})); then
  echo "== installing ${missing[*]}"
  "$PY" -m pip install -q "${missing[@]}"
fi
# pytest-xdist runs the tests in two processes (see [Note: Two test processes] in scripts/test.sh): faster, not
# needed, so a machine without network (the GPU machine) goes on without it.
if [[ "${FLATSHARD_NEEDS_TEST_DEPS:-0}" == 1 ]] && ! "$PY" -c "import importlib.metadata as m; m.version('pytest-xdist')" 2>/dev/null; then
  echo "== installing pytest-xdist"
  "$PY" -m pip install -q "pytest-xdist>=3.5" || echo "== pytest-xdist could not be installed: the tests run in one process"
fi
if [[ "${FLATSHARD_NEEDS_TEST_DEPS:-0}" == 1 ]] && ! "$PY" -c "import importlib.metadata as m; m.version('verl')" 2>/dev/null; then
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

echo "== building flatshard (torch $("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))'))"
start=$(date +%s)
# --no-build-isolation: build against the torch installed here, never download another.
"$PY" -m pip install -q --no-build-isolation --no-deps \
  -C cmake.define.FLATSHARD_BUILD_TESTS="${FLATSHARD_BUILD_TESTS:-OFF}" -C build-dir=build/release .
echo "== build took $(( $(date +%s) - start ))s"
