"""flatshard: Fully Sharded Data Parallel for PyTorch with a C++ runtime.

A drop-in for ``torch.distributed.fsdp.FullyShardedDataParallel``::

    from flatshard import FullyShardedDataParallel as FSDP

and for torch's FSDP2 (``torch.distributed.fsdp.fully_shard``)::

    from flatshard import fully_shard
"""

import torch  # noqa: F401  (loads libc10/libtorch before the extension)

from flatshard import _C, api, wrap  # noqa: F401  (flatshard._C: the runtime, for tests and tools)
from flatshard.api import *  # noqa: F401,F403  (torch's enums and configs, see api.py)
from flatshard._rank_guard import RankDivergenceError
from flatshard._stall_watch import PeerGoneError, ProcessGroupGivenUpError
from flatshard.fully_sharded_data_parallel import FullyShardedDataParallel
from flatshard._fully_shard import FSDPModule, fully_shard
from flatshard._full_params import summon_full_params as _summon_full_params
from flatshard._host_offload import move_shards_to_device, move_shards_to_host
from flatshard._torch_facade import opt_in as _as_torch


def __getattr__(name: str):
    """``flatshard.plan`` (the planner: a package that is called to plan) loads when first used, not with
    ``import flatshard``: a training process never needs it."""
    if name == "plan":
        import importlib

        return importlib.import_module("flatshard.plan")
    raise AttributeError(f"module 'flatshard' has no attribute {name!r}")


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
    _as_torch.install()


def uninstall_as_torch_fsdp() -> None:
    """Undoes ``install_as_torch_fsdp``: torch's class and helpers are torch's again."""
    _as_torch.uninstall()


def is_active() -> bool:
    """Whether torch's FSDP1 class and ``fully_shard`` give flatshard's in this process (``install_as_torch_fsdp``
    or ``FLATSHARD_AS_TORCH_FSDP=1``)."""
    return _as_torch.is_active()


FSDP = FullyShardedDataParallel

if _as_torch.environment_asks():  # (when flatshard was what imported torch, the startup hook left it to here)
    _as_torch.install(reason=f"{_as_torch.ENV_VAR}=1")

__version__ = "0.1.0"

__all__ = [*api.__all__, "FSDP", "FSDPModule", "FullyShardedDataParallel", "PeerGoneError", "ProcessGroupGivenUpError",
           "RankDivergenceError", "fully_shard",
           "install_as_torch_fsdp",
           "is_active", "move_shards_to_device", "move_shards_to_host", "plan", "summon_full_params",
           "uninstall_as_torch_fsdp", "wrap"]
