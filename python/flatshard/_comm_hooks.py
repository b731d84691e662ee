"""``register_comm_hook``: a user's gradient communication in place of flatshard's.

[Note: Communication hooks]
As torch's FSDP1: ``hook(state, grad, output)`` for sharded units (reduce the
padded unsharded flat gradient ``grad`` and scatter this rank's part into
``output``), ``hook(state, grad)`` for units of shard factor 1 (reduce ``grad``
in place). The hook does the division itself (torch's ``DefaultState`` carries
the pre- and post-divide factors); its result is accumulated into ``.grad`` as
flatshard's own reductions are. torch's default hooks (``allreduce_hook``,
``reduce_scatter_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``) and
user hooks with their own state work. The hook runs on the host at the unit's
post-backward, on the current stream, so it does not overlap the next unit's
backward as flatshard's own reductions do. Hybrid strategies take no hook (as
torch: their two-level reduction has no hook signature).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from flatshard._common import HYBRID, UsageError

if TYPE_CHECKING:
    from flatshard._state import UnitState
    from flatshard.fully_sharded_data_parallel import FullyShardedDataParallel


def register(root: FullyShardedDataParallel, state: object, hook: Callable) -> None:
    """See ``FullyShardedDataParallel.register_comm_hook``."""
    if not root.check_is_root():
        raise UsageError(
            f"FullyShardedDataParallel.register_comm_hook: expected the root unit but '{root._unit_state.name}' is "
            f"nested; call it on the outermost FSDP module (it applies to every unit)."
        )
    if not callable(hook):
        raise ValueError(f"FullyShardedDataParallel.register_comm_hook: expected a callable hook but got {hook!r}")
    states = [u._unit_state for u in root._unit_state.root.units]
    for s in states:
        if s.config.sharding_strategy in HYBRID:
            raise UsageError(
                f"FullyShardedDataParallel.register_comm_hook: unit '{s.label}' uses "
                f"{s.config.sharding_strategy}, which takes no communication hook (as torch's FSDP); use "
                f"FULL_SHARD, SHARD_GRAD_OP or NO_SHARD."
            )
        if s.comm_hook is not None:
            raise UsageError(
                "FullyShardedDataParallel.register_comm_hook: a communication hook is already registered; "
                "register one, once, before training."
            )
    for s in states:
        s.comm_hook, s.comm_hook_state = hook, state
        if s.handle is not None:  # a hook reduces the whole flat gradient ([Note: Trainable prefix])
            s.handle.set_reduce_prefix(-1)


def reduce(s: UnitState) -> None:
    """The unit's accumulated unsharded gradient through its hook, into ``.grad`` (see the note)."""
    handle = s.handle
    grad = handle.take_unsharded_grad()
    if handle.is_replicated:
        s.comm_hook(s.comm_hook_state, grad)
        output = grad
    else:
        output = torch.empty(handle.layout.shard_numel, dtype=grad.dtype, device=grad.device)
        s.comm_hook(s.comm_hook_state, grad, output)
    s.root.scheduler.accumulate_reduced_grad(handle, output)
