"""Moving every shard (and optionally the optimizer's state) to host memory and back.

[Note: Shards on the host]
RL loops (verl's PPO workers) free the accelerator between training phases: the
rollout engine needs the memory, so the training model's shards, and the optimizer's
state, go to host memory and come back for the next update. ``move_shards_to_host`` /
``move_shards_to_device`` do that for a flatshard model (the class's or fully_shard's), between iterations: each
unit's flat shard and its gradient move (``.data`` replaced, so the optimizer's
references stay valid), the runtime takes the moved shard up as after a cast (its
buffers and, with ``use_orig_params``, the original parameters' views follow; fully_shard's DTensor
parameters are swapped onto the moved shard, their identity kept), and the
optimizer's per-parameter tensors move with ``optimizer=``. Units with
``CPUOffload(offload_params=True)`` keep their shards on the host already and are left
alone. While the shards are on the host a forward raises (the model would compute with
shards copied in at every gather, slowly, and put gradients on the host): move them
back first (``_runtime._root_pre_forward`` checks ``RootState.shards_on_host``, which
``move_shard`` keeps). torch FSDP1's ``handle.flat_param_to(device)``, which verl calls unit
by unit, reaches ``move_shard`` (see [Note: torch's internals]); so do a fully_shard module's ``.cpu()`` and
``.to(device)`` back (verl's FSDP2 offload, ``offload_fsdp2_model_to_cpu``, moves the model so), for the units
under it (``FSDPModule._apply``), as torch's FSDP2 moves its shards; a move to any other device is refused by name.
"""

from __future__ import annotations

import torch
from torch import nn

from flatshard import _C, _orig_params
from flatshard._common import fsdp_modules, fully_shard_units
from flatshard._runtime import after_shard_cast, lazy_init, reshard
from flatshard._state import UnitState


def move_shards_to_host(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                        non_blocking: bool = False) -> None:
    """Moves every unit's shard and gradient in ``model`` (and ``optimizer``'s state) to host memory."""
    _move_all(model, optimizer, False, non_blocking)


def move_shards_to_device(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                          non_blocking: bool = False) -> None:
    """Moves them back to each unit's compute device (after ``move_shards_to_host``)."""
    _move_all(model, optimizer, True, non_blocking)


def _move_all(model: nn.Module, optimizer: torch.optim.Optimizer | None, to_device: bool, non_blocking: bool) -> None:
    units = fsdp_modules(model) or fully_shard_units(model)
    if not units:
        raise ValueError(f"flatshard.move_shards_to_{'device' if to_device else 'host'}: {type(model).__name__} has no "
                         f"flatshard units; wrap it (FullyShardedDataParallel) or shard it (fully_shard) first, or "
                         f"move it with .to().")
    for root in _roots(units):
        if root._unit_state.is_root is None:
            lazy_init(root)
    moves = [(u._unit_state, u._unit_state.device if to_device else torch.device("cpu")) for u in units
             if u._unit_state.handle is not None and not u._unit_state.config.offload_params]
    move_shards(moves, non_blocking)
    moved = {id(p): device  # id of a parameter the optimizer may hold -> where its shard went
             for s, device in moves for p in [s.flat_param, *(s.orig_params if s.config.use_orig_params else [])]}
    if optimizer is not None:
        _move_optimizer_state(optimizer, moved, non_blocking)


def _roots(units: list[nn.Module]) -> list[nn.Module]:
    """The outermost of ``units``: the roots their runtime is set up from."""
    inner = {id(m) for u in units for m in u.modules() if m is not u}
    return [u for u in units if id(u) not in inner]


def check_movable(s: UnitState) -> None:
    """Raises unless the unit's shard may move now: between iterations, nothing accumulated unreduced."""
    if s.root is not None and s.root.in_iteration:
        raise RuntimeError(
            f"flatshard: unit '{s.label}': its shard cannot move during a forward/backward iteration; move the "
            f"shards between steps (after the optimizer step, or after a no-grad forward).")
    if s.handle.has_unsharded_grad():
        raise RuntimeError(
            f"flatshard: unit '{s.label}' holds a gradient accumulated inside no_sync() that is not reduced yet; "
            f"move the shards after the backward outside no_sync() (and the optimizer step).")


def move_shards(moves: list[tuple[UnitState, torch.device]], non_blocking: bool = False) -> None:
    """Each unit's shard to its device, every unit checked before any moves (an error leaves none moved)."""
    for s, _ in moves:
        check_movable(s)
    for s, device in moves:
        move_shard(s, device, non_blocking)


def move_shard(s: UnitState, device: torch.device, non_blocking: bool = False) -> None:
    """Moves one unit's flat shard and its gradient to ``device`` (between iterations)."""
    root = s.root
    check_movable(s)
    if s.handle.state != _C.ShardedState.SHARDED:
        reshard(s)
    flat = s.flat_param
    device = torch.device(device)
    if flat.device == device:
        return
    flat.__dict__.pop("_local_shard", None)  # torch's alias of the old data (see HandleView.flat_param)
    if s.config.use_orig_params:  # edits to the original parameters first: they are views of the shard
        _orig_params.writeback(s)
    with torch.no_grad():
        flat.data = flat.data.to(device, non_blocking=non_blocking)
        if flat.grad is not None:
            flat.grad = flat.grad.to(device, non_blocking=non_blocking)
    after_shard_cast(s)
    if root is not None:
        root.shards_on_host = any(
            u._unit_state.handle is not None and not u._unit_state.config.offload_params
            and u._unit_state.flat_param.device != u._unit_state.device
            for u in root.units
        )


def _move_optimizer_state(optimizer: torch.optim.Optimizer, moved: dict[int, torch.device],
                          non_blocking: bool) -> None:
    """The per-element state (Adam's moments, ...) of the parameters whose shards moved goes where they went;
    scalars such as ``step`` stay where the optimizer keeps them, and other parameters' state is left alone."""
    for param, state in optimizer.state.items():
        device = moved.get(id(param))
        if device is None:
            continue
        for key, value in list(state.items()):
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.device != device:
                state[key] = value.to(device, non_blocking=non_blocking)
