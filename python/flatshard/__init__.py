"""flatshard: Fully Sharded Data Parallel for PyTorch with a C++ runtime.

A drop-in for ``torch.distributed.fsdp.FullyShardedDataParallel``::

    from flatshard import FullyShardedDataParallel as FSDP

and for torch's FSDP2 (``torch.distributed.fsdp.fully_shard``)::

    from flatshard import fully_shard
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

# [Note: A lazy import]
# ``import flatshard`` loads nothing but this file: torch and the runtime load with the first name used
# (``flatshard.FullyShardedDataParallel``, ``from flatshard import fully_shard``, ``flatshard._C``, ...), through
# the module's ``__getattr__``. So ``python -m flatshard.plan`` answers a bad argument in a fraction of a second, before
# torch (2.7 s here) and torch's FSDP (1.3 s more) are imported, and a tool that imports flatshard to read its version
# pays nothing. Every public name resolves as before; ``import flatshard._C`` imports torch first (a finder, at the end
# of this file); ``FLATSHARD_AS_TORCH_FSDP=1`` installs the opt-in when torch is imported, or at once if it was.

# Public name: the module it lives in (loaded on first use).
_LAZY = {
    **{name: "flatshard.api" for name in (
        "BackwardPrefetch", "CPUOffload", "FullOptimStateDictConfig", "FullStateDictConfig",
        "LocalOptimStateDictConfig", "LocalStateDictConfig", "MixedPrecision", "ShardedOptimStateDictConfig",
        "ShardedStateDictConfig", "ShardingStrategy", "StateDictSettings", "StateDictType")},  # (api.__all__: tested)
    "RankDivergenceError": "flatshard._rank_guard",
    "PeerGoneError": "flatshard._stall_watch",
    "ProcessGroupGivenUpError": "flatshard._stall_watch",
    "FullyShardedDataParallel": "flatshard.fully_sharded_data_parallel",
    "FSDP": "flatshard.fully_sharded_data_parallel",
    "FSDPModule": "flatshard._fsdp_module",
    "fully_shard": "flatshard._fully_shard",
    "move_shards_to_device": "flatshard._host_offload",
    "move_shards_to_host": "flatshard._host_offload",
}

if TYPE_CHECKING:  # (what the names are, for type checkers and editors)
    from flatshard import _C, api, plan, wrap  # noqa: F401
    from flatshard._fsdp_module import FSDPModule  # noqa: F401
    from flatshard._fully_shard import fully_shard  # noqa: F401
    from flatshard._host_offload import move_shards_to_device, move_shards_to_host  # noqa: F401
    from flatshard._rank_guard import RankDivergenceError  # noqa: F401
    from flatshard._stall_watch import PeerGoneError, ProcessGroupGivenUpError  # noqa: F401
    from flatshard.api import *  # noqa: F401,F403
    from flatshard.fully_sharded_data_parallel import FullyShardedDataParallel  # noqa: F401
    from flatshard.fully_sharded_data_parallel import FullyShardedDataParallel as FSDP  # noqa: F401


def __getattr__(name: str) -> Any:
    """The public names and the submodules, loaded when first used (see [Note: A lazy import])."""
    module = _LAZY.get(name)
    if module is not None:
        import torch  # noqa: F401  (loads libc10/libtorch before the extension)

        value = getattr(importlib.import_module(module), "FullyShardedDataParallel" if name == "FSDP" else name)
    elif name.startswith("__"):
        raise AttributeError(f"module 'flatshard' has no attribute {name!r}")
    else:
        if name != "plan":
            import torch  # noqa: F401,F811
        try:
            value = importlib.import_module(f"flatshard.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"flatshard.{name}":
                raise
            raise AttributeError(f"module 'flatshard' has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def summon_full_params(module, recurse: bool = True, writeback: bool = True, rank0_only: bool = False,
                       offload_to_cpu: bool = False, with_grads: bool = False):
    """``FullyShardedDataParallel.summon_full_params`` with the combinations torch's FSDP1 refuses:
    ``rank0_only`` with ``writeback`` (the first rank's edits reach every rank), ``offload_to_cpu`` with
    NO_SHARD units, ``with_grads`` with ``use_orig_params=False`` or ``offload_to_cpu``. Collective."""
    return _summon_full_params(module, recurse, writeback, rank0_only, offload_to_cpu, with_grads)


def install_as_torch_fsdp() -> None:
    """From now on, in this process, torch's ``torch.distributed.fsdp.FullyShardedDataParallel`` and ``fully_shard``
    are flatshard's: code that constructs torch's class (accelerate, the HF Trainer, TRL, Lightning, verl), calls its
    static methods, calls torch's ``fully_shard`` (by ``torch.distributed.fsdp`` or the older
    ``torch.distributed._composable.fsdp``), or uses ``torch.distributed.checkpoint.state_dict``'s helpers gets
    flatshard, whatever the import order; a call that still reaches torch's ``fully_shard`` warns once.
    ``FLATSHARD_AS_TORCH_FSDP=1`` in the environment does this at interpreter start (every ``torchrun`` /
    ``accelerate launch`` worker). See "Using it with frameworks" in the README and [Note: flatshard as torch's FSDP]."""
    _opt_in().install()


def uninstall_as_torch_fsdp() -> None:
    """Undoes ``install_as_torch_fsdp``: torch's class and helpers are torch's again."""
    _opt_in().uninstall()


def is_active() -> bool:
    """Whether torch's FSDP1 class and ``fully_shard`` give flatshard's in this process (``install_as_torch_fsdp``
    or ``FLATSHARD_AS_TORCH_FSDP=1``)."""
    return _opt_in().is_active()


def _opt_in() -> Any:
    import torch  # noqa: F401

    return importlib.import_module("flatshard._torch_facade.opt_in")


def _summon_full_params(*args: Any) -> Any:
    from flatshard._full_params import summon_full_params as summon

    return summon(*args)


def _environment_asks() -> bool:  # (as flatshard._torch_facade.opt_in.environment_asks, without importing torch)
    import os

    return os.environ.get("FLATSHARD_AS_TORCH_FSDP", "").strip().lower() not in ("", "0", "false", "no", "off")


__version__ = "0.1.0"

__all__ = [*(name for name, module in _LAZY.items() if module == "flatshard.api"), "FSDP", "FSDPModule",
           "FullyShardedDataParallel", "PeerGoneError", "ProcessGroupGivenUpError", "RankDivergenceError", "fully_shard",
           "install_as_torch_fsdp", "is_active", "move_shards_to_device", "move_shards_to_host", "plan",
           "summon_full_params", "uninstall_as_torch_fsdp", "wrap"]

class _TorchBeforeTheExtension:
    """A meta-path finder that imports torch before ``import flatshard._C`` loads the extension (which needs
    libtorch loaded; ``flatshard._C`` through this module's ``__getattr__`` does the same): it finds nothing itself."""

    @staticmethod
    def find_spec(fullname: str, path: Any = None, target: Any = None) -> None:
        if fullname == "flatshard._C":
            import torch  # noqa: F401


if not any(isinstance(finder, type) and finder.__name__ == "_TorchBeforeTheExtension" for finder in sys.meta_path):
    sys.meta_path.insert(0, _TorchBeforeTheExtension)  # type: ignore[arg-type]

if _environment_asks():
    if "torch" in sys.modules:  # (imported before flatshard: the startup hook could not find flatshard complete)
        _opt_in().install(reason="FLATSHARD_AS_TORCH_FSDP=1")
    else:  # installs as soon as torch is imported (what the site-packages startup hook does; see _flatshard_startup)
        try:
            import _flatshard_startup  # noqa: F401
        except ImportError:  # (not installed: flatshard run from a source tree) now, then
            _opt_in().install(reason="FLATSHARD_AS_TORCH_FSDP=1")
