"""flatshard: Fully Sharded Data Parallel for PyTorch with a C++ runtime.

A drop-in for ``torch.distributed.fsdp.FullyShardedDataParallel``::

    from flatshard import FullyShardedDataParallel as FSDP
"""

import torch  # noqa: F401  (loads libc10/libtorch before the extension)

from flatshard import _C, api, wrap  # noqa: F401  (flatshard._C: the runtime, for tests and tools)
from flatshard.api import *  # noqa: F401,F403  (torch's enums and configs, see api.py)
from flatshard._rank_guard import RankDivergenceError
from flatshard.fully_sharded_data_parallel import FullyShardedDataParallel
from flatshard._full_params import summon_full_params as _summon_full_params


def summon_full_params(module, recurse: bool = True, writeback: bool = True, rank0_only: bool = False,
                       offload_to_cpu: bool = False, with_grads: bool = False):
    """``FullyShardedDataParallel.summon_full_params`` with the combinations torch's FSDP1 refuses:
    ``rank0_only`` with ``writeback`` (the first rank's edits reach every rank), ``offload_to_cpu`` with
    NO_SHARD units, ``with_grads`` with ``use_orig_params=False`` or ``offload_to_cpu``. Collective."""
    return _summon_full_params(module, recurse, writeback, rank0_only, offload_to_cpu, with_grads)

FSDP = FullyShardedDataParallel

__version__ = "0.1.0"

__all__ = [*api.__all__, "FSDP", "FullyShardedDataParallel", "RankDivergenceError", "summon_full_params", "wrap"]
