"""What one training step moves and holds, per unit and per rank, from the planned units.

[Note: What a step moves]
Per unit, for one forward and one backward whose gradients are reduced (the input bytes of
each collective, as the runtime counts them, see [Note: Collective byte counters]):
- a sharded unit (shard factor > 1) all-gathers its shard in ``param_dtype`` before its
  forward, and again before its backward if it reshards after forward (FULL_SHARD and
  HYBRID_SHARD; never the root, which stays unsharded from its forward to its backward);
- it reduce-scatters its whole padded flat gradient in ``reduce_dtype``, or, with original
  parameters mixing frozen and trainable ones, all-reduces the trainable prefix only
  ([Note: Trainable prefix]);
- with hybrid sharding it then all-reduces its gradient shard over the replicate group;
- a replicated unit (NO_SHARD, or a shard group of one) gathers nothing and all-reduces its
  gradient over the shard group when that group has more than one rank.
Inside ``no_sync()`` the reductions wait for the first backward outside it.

[Note: What a rank holds]
Between steps: every unit's shard (the parameters' dtype), its gradient (after backward
until ``zero_grad``) and the optimizer's per-element state (Adam: two tensors the shard's
size; SGD with momentum: one), on the host with ``CPUOffload``. During a step, on top:
unsharded buffers (``param_dtype``, padded) of the units in flight, the root's from its
forward to the end of backward, with FULL_SHARD the current unit and the one being
prefetched (the limiter lets two all-gathers be in flight), with SHARD_GRAD_OP every unit
from its forward to its backward; in backward the unit's unsharded gradient
(``param_dtype``) and its reduction's input (``reduce_dtype``, when that differs) and output.
Inside ``no_sync()`` every unit's unsharded gradient is held until the reduction
(``keep_parameters_unsharded=True``: the unsharded parameters too). The optimizer's step
adds its temporaries (Adam: two the size of what it updates at once, every shard with
``foreach``, torch's default on GPUs; one shard at a time, a third, the previous shard's,
is still alive). Activations are the
model's and not flatshard's: they come from a measured step when one is given (the peak of a
plain local forward and backward on one rank's batch, less the gradients it made: its
parameters were there before).
"""

from __future__ import annotations

import dataclasses

import torch

from flatshard.plan._units import PlannedUnit

# Per-element optimizer state, in tensors the size of the shard (the shard's dtype).
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd": 0, "sgd_momentum": 1, "none": 0}


def _size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


@dataclasses.dataclass
class UnitTraffic:
    """Input bytes of one unit's collectives in one step (see [Note: What a step moves])."""

    all_gather: int = 0
    reduce_scatter: int = 0
    all_reduce: int = 0
    replica_all_reduce: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"all_gather": self.all_gather, "reduce_scatter": self.reduce_scatter, "all_reduce": self.all_reduce,
                "replica_all_reduce": self.replica_all_reduce}


def unit_traffic(unit: PlannedUnit, shard_group_size: int, replicate_group_size: int) -> UnitTraffic:
    layout = unit.layout
    traffic = UnitTraffic()
    reduce_size = _size(unit.reduce_dtype)
    if unit.replicated:
        if shard_group_size > 1 and unit.trainable_numel:
            traffic.all_reduce = layout.padded_numel * reduce_size
        return traffic
    gathers = 1 + (unit.reshard_after_forward and not unit.is_root)
    traffic.all_gather = gathers * layout.shard_numel * _size(unit.param_dtype)
    if not unit.trainable_numel:
        return traffic
    if unit.reduces_prefix:
        traffic.all_reduce = _trainable_prefix(unit) * reduce_size
    else:
        traffic.reduce_scatter = layout.padded_numel * reduce_size
    if replicate_group_size > 1:
        traffic.replica_all_reduce = layout.shard_numel * reduce_size
    return traffic


def _trainable_prefix(unit: PlannedUnit) -> int:
    """Elements up to the end of the last trainable parameter (trainable ones come first)."""
    remaining, end = unit.trainable_numel, 0
    for numel, offset in zip(unit.layout.numels, unit.layout.offsets):
        if remaining <= 0:
            break
        remaining -= numel
        end = offset + numel
    return end


@dataclasses.dataclass
class RankMemory:
    """Bytes one rank holds (see [Note: What a rank holds])."""

    sharded_params: int
    gradients: int
    optimizer_state: int
    on_host: int  # of the above, what CPUOffload keeps in host memory
    unsharded_forward: int  # at the worst point of forward
    unsharded_backward: int  # at the worst point of backward (gradients and reduction buffers included)
    no_sync_gradients: int  # held across no_sync() micro-batches
    optimizer_step: int  # the optimizer's temporaries during its step
    activations: int | None  # from a measured step, or None

    @property
    def device_peak(self) -> int:
        steady = self.sharded_params + self.gradients + self.optimizer_state - self.on_host
        step = max(self.unsharded_forward, self.unsharded_backward) + (self.activations or 0)
        return steady + max(step, 0 if self.on_host else self.optimizer_step)

    def as_dict(self) -> dict[str, int | None]:
        return {**dataclasses.asdict(self), "device_peak": self.device_peak}


def rank_memory(units: list[PlannedUnit], optimizer: str, offload_params: bool, no_sync: bool,
                activations: int | None = None, optimizer_foreach: bool = True, gloo: bool = False) -> RankMemory:
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"flatshard.plan: optimizer: expected one of {sorted(OPTIMIZER_STATES)} but got {optimizer!r}")
    shards = sum(u.layout.shard_numel * _size(u.dtype) for u in units)
    grads = sum(u.layout.shard_numel * _size(u.dtype) for u in units if u.trainable_numel)
    optim = OPTIMIZER_STATES[optimizer] * sum(u.layout.shard_numel * _size(u.dtype) for u in units
                                              if u.trainable_numel)
    forward, backward = _unsharded_in_flight(units, offload_params, gloo)
    held = sum(u.layout.padded_numel * _size(u.param_dtype) for u in units if u.trainable_numel) if no_sync else 0
    trainable_shards = [u.layout.shard_numel * _size(u.dtype) for u in units if u.trainable_numel]
    step_temporaries = 0
    if OPTIMIZER_STATES[optimizer] == 2 and trainable_shards:
        step_temporaries = _adam_step_temporaries(trainable_shards, optimizer_foreach)
    return RankMemory(
        sharded_params=shards, gradients=grads, optimizer_state=optim, optimizer_step=step_temporaries,
        on_host=(shards + grads + optim) if offload_params else 0,
        unsharded_forward=forward, unsharded_backward=backward + held, no_sync_gradients=held,
        activations=activations,
    )


def _unsharded_in_flight(units: list[PlannedUnit], offload_params: bool, gloo: bool) -> tuple[int, int]:
    """The worst points of forward and backward (units in forward order; backward runs them in reverse)."""
    root = sum(_unsharded_bytes(u, offload_params) for u in units if u.is_root)
    root_grad = sum(_backward_grad_bytes(u) for u in units if u.is_root)
    others = [u for u in units if not u.is_root]
    if not others:
        return root, root + root_grad
    buffers = [_unsharded_bytes(u, offload_params) for u in others]
    # gloo's all-gather writes a flat copy of its output while it runs (see [Note: gloo's temporaries]).
    copies = [b if gloo and not u.replicated else 0 for u, b in zip(others, buffers)]
    grads = [_backward_grad_bytes(u) for u in others]
    # A unit's reduction is still in flight during the next unit's backward, its input held.
    reducing = [u.layout.padded_numel * _size(u.reduce_dtype) if u.trainable_numel and not u.replicated else 0
                for u in others] + [0]
    n = len(others)
    if any(u.reshard_after_forward for u in others):  # the current unit and the one prefetched
        forward = root + max(buffers[i] + (buffers[i + 1] + copies[i + 1] if i + 1 < n else 0) for i in range(n))
        backward = root + max(
            buffers[i] + grads[i] + (buffers[i - 1] + copies[i - 1] if i else 0) + reducing[i + 1] for i in range(n))
    else:  # every unit stays unsharded from its forward to its backward
        forward = root + sum(buffers) + (copies[-1] if copies else 0)
        backward = root + max(sum(buffers[: i + 1]) + grads[i] + reducing[i + 1] for i in range(n))
    return forward, max(backward, root + root_grad + reducing[0])


def _adam_step_temporaries(shards: list[int], foreach: bool) -> int:
    """Adam's step makes two temporaries the size of what it updates at once (the second moment's square root,
    then its division, ``denom``): every shard at once with ``foreach``. One tensor at a time, the previous
    tensor's ``denom`` is still referenced while the next one's is computed: three, of two sizes (shards in
    the optimizer's order, which is the units' order)."""
    if foreach:
        return 2 * sum(shards)
    return max(2 * size + (shards[i - 1] if i else 0) for i, size in enumerate(shards))


def _unsharded_bytes(unit: PlannedUnit, offload_params: bool) -> int:
    """The unit's unsharded buffer: none for a replicated unit computing in its own dtype on its device."""
    if unit.replicated and unit.param_dtype == unit.dtype and not offload_params:
        return 0
    return unit.layout.padded_numel * _size(unit.param_dtype)


def _backward_grad_bytes(unit: PlannedUnit) -> int:
    """In a unit's backward, beyond its gradient shard: autograd's gradients of its parameters (until they are
    flattened), its unsharded gradient (a replicated unit's becomes the shard's gradient itself) and the
    reduction's input when it is cast to ``reduce_dtype``."""
    if not unit.trainable_numel:
        return 0
    layout = unit.layout
    autograd = unit.trainable_numel * _size(unit.param_dtype)
    grad = 0 if unit.replicated else layout.padded_numel * _size(unit.param_dtype)
    cast = layout.padded_numel * _size(unit.reduce_dtype) if unit.reduce_dtype != unit.param_dtype else 0
    return autograd + grad + cast
