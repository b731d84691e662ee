"""The build: flatshard._C shares the process's libstdc++ with torch.

On the GPU machine the default compiler (``CXX=/opt/gcc/bin/g++``) linked libstdc++
statically into ``_C``; the module then carried a second copy and segfaulted on its
first error message that formats a number (see [Note: One libstdc++ with torch] in
CMakeLists.txt). These tests check the built module, and that CMake refuses such a
compiler instead of building a module that crashes.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys

import pytest

import flatshard._C as _C

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF and libstdc++ are Linux's")


@linux_only
def test_module_links_the_shared_libstdcxx():
    with open(_C.__file__, "rb") as f:
        data = f.read()
    assert b"libstdc++.so" in data, f"{_C.__file__} does not load libstdc++.so: it carries its own copy"


@linux_only
def test_error_messages_with_numbers_do_not_crash():
    import torch

    layout = _C.FlatParamLayout([[2, 3]], 2)
    with pytest.raises(RuntimeError, match=r"tensor 0 has shape \[5\] but the layout expects \[2, 3\]"):
        _C.flatten([torch.zeros(5)], layout)


@linux_only
@pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("c++") is None, reason="needs cmake and c++")
def test_cmake_refuses_a_compiler_that_links_libstdcxx_statically(tmp_path):
    wrapper = tmp_path / "static-cxx"
    wrapper.write_text(f'#!/bin/sh\nexec {shutil.which("c++")} -static-libstdc++ "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "CXX": str(wrapper)}
    got = subprocess.run(["cmake", "-S", ROOT, "-B", str(tmp_path / "build"), f"-DPython_EXECUTABLE={sys.executable}"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert got.returncode != 0, "CMake accepted a compiler that links libstdc++ statically"
    message = " ".join(got.stderr.split())  # CMake wraps its messages
    assert "links libstdc++ statically into shared libraries" in message, got.stderr[-2000:]
    assert "CXX=/usr/bin/c++" in message, got.stderr[-2000:]
