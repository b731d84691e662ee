"""Honours ``FLATSHARD_AS_TORCH_FSDP=1`` at interpreter start (imported by ``flatshard_as_torch_fsdp.pth`` in
site-packages, so that every ``torchrun`` / ``accelerate launch`` worker gets it).

Without the variable this does nothing else. With it, flatshard is installed as torch's FSDP1 class (see
[Note: flatshard as torch's FSDP] in flatshard/_as_torch.py) as soon as ``torch`` has been imported, not
before: a process that never imports torch pays nothing, and torch is complete when flatshard loads.
"""

import os
import sys

_VALUE = os.environ.get("FLATSHARD_AS_TORCH_FSDP", "").strip().lower()


def _install() -> None:
    import flatshard

    flatshard._as_torch.install(reason="FLATSHARD_AS_TORCH_FSDP=1")


class _AfterTorchImport:
    """A meta-path finder that lets ``import torch`` run as usual, then installs flatshard."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_torch = spec.loader.exec_module

        def exec_module(module):
            exec_torch(module)
            _install()

        spec.loader.exec_module = exec_module
        return spec


if _VALUE not in ("", "0", "false", "no", "off"):
    if "torch" in sys.modules:
        _install()
    else:
        sys.meta_path.insert(0, _AfterTorchImport())
