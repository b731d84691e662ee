"""flatshard: Fully Sharded Data Parallel for PyTorch with a C++ runtime.

A drop-in for ``torch.distributed.fsdp.FullyShardedDataParallel``::

    from flatshard import FullyShardedDataParallel as FSDP
"""

import torch  # noqa: F401  (loads libc10/libtorch before the extension)

from flatshard import _C, api, wrap  # noqa: F401  (flatshard._C: the runtime, for tests and tools)
from flatshard.api import *  # noqa: F401,F403  (torch's enums and configs, see api.py)
from flatshard._rank_guard import RankDivergenceError
from flatshard.fully_sharded_data_parallel import FullyShardedDataParallel

FSDP = FullyShardedDataParallel

__version__ = "0.1.0"

__all__ = [*api.__all__, "FSDP", "FullyShardedDataParallel", "RankDivergenceError", "wrap"]
