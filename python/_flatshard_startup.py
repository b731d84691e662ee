"""Honours ``FLATSHARD_AS_TORCH_FSDP=1`` at interpreter start (imported by ``flatshard_as_torch_fsdp.pth`` in
site-packages, so that every ``torchrun`` / ``accelerate launch`` worker gets it).

Without the variable this does nothing else. With it, flatshard is installed as torch's FSDP1 class (see
[Note: flatshard as torch's FSDP] in flatshard/_torch_facade/opt_in.py) as soon as ``import torch`` has run, not before:
a process that never imports torch pays nothing, and torch is complete when flatshard loads. The finder stays
on ``sys.meta_path`` until torch is executed: probes such as ``importlib.util.find_spec("torch")`` (transformers,
datasets and peft make them at import) get a spec of their own and change nothing. When flatshard itself is
what imports torch, its ``__init__`` installs at its end instead (it reads the same variable).

PYTEST_DONT_REWRITE: pytest marks every module of a distribution that registers a plugin
(flatshard.testing) for assertion rewriting, and warns about one imported before it started,
as this one always is; it has no assertions to rewrite.
"""

import os
import sys

ENV_VAR = "FLATSHARD_AS_TORCH_FSDP"  # (flatshard._torch_facade.opt_in.ENV_VAR: this module must not import flatshard)


def wanted() -> bool:
    return os.environ.get(ENV_VAR, "").strip().lower() not in ("", "0", "false", "no", "off")


def _install() -> None:
    package = sys.modules.get("flatshard")
    if package is not None and getattr(getattr(package, "__spec__", None), "_initializing", False):
        return  # flatshard is importing torch: its __init__ installs when it is complete
    import flatshard._torch_facade.opt_in as opt_in

    opt_in.install(reason=f"{ENV_VAR}=1")


class _AfterTorchImport:
    """A meta-path finder that lets ``import torch`` run as usual, then installs flatshard."""

    def __init__(self) -> None:
        self._finding = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch" or self._finding:
            return None
        self._finding = True
        try:
            spec = None
            for finder in sys.meta_path:
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._finding = False
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_torch = loader.exec_module

        def exec_module(module):
            exec_torch(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            _install()

        loader.exec_module = exec_module
        return spec


if wanted():
    if "torch" in sys.modules:
        _install()
    else:
        sys.meta_path.insert(0, _AfterTorchImport())
