"""What one training step moves and holds, per unit and per rank, from the planned units.

[Note: What a step moves]
Per unit, for one forward and one backward whose gradients are reduced (the input bytes of
each collective, as the runtime counts them, see [Note: Collective byte counters]):
- a sharded unit (shard factor > 1) all-gathers its shard in ``param_dtype`` before its
  forward, and again before its backward if it reshards after forward (FULL_SHARD and
  HYBRID_SHARD; never the root, which stays unsharded from its forward to its backward, unless
  fully_shard was given reshard_after_forward=True);
- it reduce-scatters its whole padded flat gradient in ``reduce_dtype``, or, with original
  parameters mixing frozen and trainable ones, all-reduces the trainable prefix only
  ([Note: Trainable prefix]); fully_shard's reduce-scatters the trainable parameters' rows of
  every rank's shard;
- with hybrid sharding it then all-reduces its gradient shard over the replicate group;
- a replicated unit (NO_SHARD, or a shard group of one) gathers nothing and all-reduces its
  gradient over the shard group when that group has more than one rank.
Inside ``no_sync()`` the reductions wait for the first backward outside it.

[Note: What a rank holds]
Between steps: every unit's shard (the parameters' dtype) and the optimizer's per-element state
(Adam: two tensors the shard's size; SGD with momentum: one), on the host with ``CPUOffload``.
A step is then walked point by point (``_Timeline``), and the peak is the highest point:
- units in the order they run (from the activation profile, see [Note: A unit's backward in the profile];
  registration order without one);
- forward: the root's unsharded buffer (it stays unsharded until the end of backward), with
  FULL_SHARD the current unit's and the prefetched one's (the limiter lets two all-gathers be
  in flight), with SHARD_GRAD_OP every unit's so far; the activations at their highest in forward;
- each unit's backward, in reverse order, at three points (the scheduler's order: a unit's
  post-backward completes the previous unit's reduction, reshards the unit's parameters, and only
  then makes its flat gradient):
  - as it starts: the same buffers (the unit's and, with FULL_SHARD, the one it prefetches, whose
    all-gather is being issued), the previous unit's reduction still in flight (its input), the
    gradient shards of the units reduced so far (``zero_grad(set_to_none=True)`` left none), and
    the activations held then;
  - while it computes: the same, with autograd's gradients of the unit's parameters as they
    appear and the activations as they are freed, at their worst together;
  - its post-backward: the unit's buffer gone, autograd's gradients, the unsharded flat gradient
    in ``param_dtype``, its cast to ``reduce_dtype`` and the reduction's scratch, and the
    activations left;
  (activations measured unit by unit, [Note: Activations unit by unit], or a unit's share freed
  evenly over its backward with its gradients all made at the worst point);
- before each unit's backward, what the root's own backward holds since the last unit's (the loss's and the
  head's): the root's gradients made by then, the unit gathered (FULL_SHARD's first one only from the
  root's pre-backward on);
  the root's gradients count from their allocation on throughout (from the start of backward without a
  profile);
- the optimizer's step: every gradient shard and its temporaries (Adam: two the size of what it
  updates at once, every shard with ``foreach``, torch's default on GPUs; one shard at a time,
  a third, the previous shard's, is still alive).
Inside ``no_sync()`` every unit holds its unsharded gradient until the first backward outside it
reduces it (``keep_parameters_unsharded=True``: the unsharded parameters too). The backend adds
its own: gloo's all-gather holds a flat copy of its output and its all-reduce (a reduce-scatter
on gloo) a scratch of its input over the group, at most about 2 MB, both until they complete on
gloo's threads; torch's fake process group completes a collective within its call, holding a
view per rank (504 bytes each) meanwhile. In host memory, beside the tensors, flatshard's own
records per parameter and each gloo group a wrap makes (``runtime_host``, counted in
``combined_peak``). Activations are the model's, not flatshard's: they come from a measured step
when one is given ([Note: Measuring activations]).
The plan against measured peaks: benchmarks/RESULTS.md.
"""

from __future__ import annotations

import dataclasses

import torch

from flatshard.plan._activations import ActivationProfile, UnitActivations
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
    gathers = 1 + (unit.reshard_after_forward and (not unit.is_root or unit.root_reshards_after_forward))
    traffic.all_gather = gathers * layout.shard_numel * _size(unit.param_dtype)
    if not unit.trainable_numel:
        return traffic
    if unit.reduces_prefix:
        traffic.all_reduce = _trainable_prefix(unit) * reduce_size
    elif unit.reduce_shard_numel is not None:  # fully_shard's: the trainable rows of every rank's shard
        traffic.reduce_scatter = unit.reduce_shard_numel * layout.shard_factor * reduce_size
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
    """Bytes one rank holds (see [Note: What a rank holds]): device and host apart, and together."""

    sharded_params: int
    gradients: int  # gradient shards, from their unit's reduction to zero_grad
    optimizer_state: int
    on_host: int  # of the above, what CPUOffload keeps in host memory
    forward_in_flight: int  # at the worst point of forward: unsharded buffers (and held no_sync gradients)
    backward_in_flight: int  # at the worst point of backward: buffers, unsharded gradients, reductions, shards so far
    no_sync_gradients: int  # unsharded gradients held across no_sync() micro-batches
    optimizer_step: int  # the optimizer's temporaries during its step
    activations: int | None  # from a measured step, or None
    runtime_host: int  # flatshard's own objects per parameter, in host memory (see RUNTIME_HOST_BYTES_PER_PARAM)
    device_peak: int  # the highest point of forward, backward and the optimizer's step, on the device
    combined_peak: int  # the same with device and host in one memory (a run on a CPU, offloaded or not)

    def as_dict(self) -> dict[str, int | None]:
        return dataclasses.asdict(self)


def rank_memory(units: list[PlannedUnit], optimizer: str, offload_params: bool, no_sync: bool,
                activations: int | ActivationProfile | None = None, optimizer_foreach: bool = True,
                backend: str = "nccl", compute_on_host: bool = False, shard_group_size: int = 1,
                new_groups: int = 0, gather_together: int = 0) -> RankMemory:
    """``compute_on_host``: the device is the host itself (a CPU run): offloaded shards are used where they are.
    ``gather_together``: fully_shard's bytes of small units gathered (and, on two gloo ranks, reduced) together (see
    [Note: fully_shard gathers small units together] in flatshard/_fsdp2_config.py); 0: one unit a collective.
    ``new_groups``: the process groups the wrap creates (hybrid sharding's two).
    ``activations``: one number (spread evenly over backward) or a measured profile."""
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"flatshard.plan: optimizer: expected one of {sorted(OPTIMIZER_STATES)} but got {optimizer!r}")
    shards = sum(u.layout.shard_numel * _size(u.dtype) for u in units)
    grads = sum(_grad_shard_bytes(u) for u in units)
    optim = OPTIMIZER_STATES[optimizer] * grads
    trainable_shards = [_grad_shard_bytes(u) for u in units if u.trainable_numel]
    step_temporaries = 0
    if OPTIMIZER_STATES[optimizer] == 2 and trainable_shards:
        step_temporaries = _adam_step_temporaries(trainable_shards, optimizer_foreach)
    timeline = _Timeline(units, offload_params and not compute_on_host, backend, no_sync, activations,
                         shard_group_size, on_host=compute_on_host, gather_together=gather_together)
    peak_activations = activations.peak if isinstance(activations, ActivationProfile) else activations
    on_host = (shards + grads + optim) if offload_params else 0
    # On the device: what is there between steps, then the highest of forward, backward and the step.
    device_steady = 0 if offload_params else shards + optim
    device = device_steady + max(timeline.forward, timeline.backward(grads_on_device=not offload_params),
                                 0 if offload_params else grads + step_temporaries)
    runtime_host = sum(len(u.param_names) * RUNTIME_HOST_BYTES_PER_PARAM[u.replicated] for u in units)
    if backend == "gloo":
        runtime_host += GLOO_GROUP_HOST_BYTES * new_groups + GLOO_BYTES_PER_PEER * (shard_group_size - 1)
    combined = shards + optim + runtime_host + max(timeline.forward, timeline.backward(grads_on_device=True),
                                                   grads + step_temporaries)
    return RankMemory(
        sharded_params=shards, gradients=grads, optimizer_state=optim, on_host=on_host,
        forward_in_flight=timeline.forward - timeline.forward_activations,
        backward_in_flight=timeline.backward_in_flight(grads_on_device=not offload_params),
        no_sync_gradients=timeline.held_across_no_sync, optimizer_step=step_temporaries, activations=peak_activations,
        runtime_host=runtime_host,
        device_peak=device, combined_peak=combined)


# What flatshard's runtime keeps per parameter in host memory between steps, beside the tensors: the placeholder and
# the view it swaps into the module, their hooks, the autograd nodes it keeps, its Python records. Measured with the
# malloc counter (tests' GPT, 2 to 16 blocks of 11 parameters, fake group): 20.4 KB more per sharded block, 12.8 KB
# per replicated one. Nothing on a GPU; on a CPU a few percent of a toy model's peak.
RUNTIME_HOST_BYTES_PER_PARAM = {False: 1_860, True: 1_160}  # by whether the unit is replicated
# A gloo process group's own host memory (its context, its connections' buffers): hybrid sharding's wrap makes two
# (measured: 155-160 KB more per hybrid wrap than per FULL_SHARD one at W = 2 and 4).
GLOO_GROUP_HOST_BYTES = 80_000
# Every wrap's rank guard makes a gloo group of its ranks (for its descriptions) and its links: measured 40 KB per peer
# (40 KB at W = 2, 120 KB at W = 4) beyond the rest of ``runtime_host``.
GLOO_BYTES_PER_PEER = 40_000


class _Timeline:
    """The transient bytes of one step, point by point (see [Note: What a rank holds]): units in forward order
    (the root's first: it stays unsharded from its forward to the end of backward); backward runs them in
    reverse, each unit's gradient shard appearing at its reduction, activations freed as their units' backward
    runs (as measured, or evenly)."""

    def __init__(self, units: list[PlannedUnit], copies_to_device: bool, backend: str, no_sync: bool,
                 activations: int | ActivationProfile | None, group_size: int, on_host: bool = False,
                 gather_together: int = 0) -> None:
        roots = [u for u in units if u.is_root]
        others = [u for u in units if not u.is_root]
        trainable_names = [u.param_names if u.trainable_numel else () for u in others]
        if isinstance(activations, ActivationProfile):  # the order the units run in (registration order otherwise)
            order = activations.run_order(trainable_names)
            others, trainable_names = [others[i] for i in order], [trainable_names[i] for i in order]
        self.n = len(others)
        # Per unit: its own autograd gradients while its backward computes, the flat gradient its post-backward makes
        # (after resharding its parameters) and the cast to reduce_dtype.
        self.autograd = [_autograd_grad_bytes(u) for u in others]
        self.flat = [_flat_grad_bytes(u) for u in others]
        if isinstance(activations, ActivationProfile):
            self.acts = activations.at_units(trainable_names, on_host=on_host,
                                             root_params=[n for u in roots if u.trainable_numel for n in u.param_names],
                                             unit_names=[u.name for u in others])
        else:
            self.acts = UnitActivations.even(activations or 0, self.autograd,
                                             sum(_autograd_grad_bytes(u) for u in roots))
        self.forward_activations = self.acts.forward
        # The root: unsharded from its forward to its post-backward, its autograd gradients as they are made (the
        # head's before the blocks', the embedding's last: self.acts.root_at_*; all of them from the start of backward
        # without a profile); its flat gradient, cast and reduction at its own post-backward, the last point.
        self.root = sum(_unsharded_bytes(u, copies_to_device) for u in roots)
        self.root_post = sum(_autograd_grad_bytes(u) + _flat_grad_bytes(u) + _cast_bytes(u) + _shard_output_bytes(u)
                             for u in roots)
        self.root_forward = sum(_unsharded_bytes(u, copies_to_device) for u in roots)
        self.buffers = [_unsharded_bytes(u, copies_to_device) for u in others]
        gloo = backend == "gloo"
        # gloo's all-gather writes a flat copy of its output while it runs (see [Note: gloo's temporaries]; two ranks
        # exchange halves straight into it: [Note: Two gloo ranks exchange halves]); the fake group's makes a view per
        # rank.
        self.copies = [0 if u.replicated or (gloo and group_size == 2) else b if gloo
                       else _collective_scratch(backend, group_size) for u, b in zip(others, self.buffers)]
        self.shards = [_grad_shard_bytes(u) for u in others]
        self.root_shards = sum(_grad_shard_bytes(u) for u in roots)
        # A unit's reduction is completed at the next unit's post-backward: its input is held through that unit's
        # compute on any backend (under torch's fake process group too, where the collective itself is done at once).
        # (gloo's collectives run on its threads, holding their temporaries until they complete; the fake group's are
        # done when the call returns)
        self.copy_outlives_call = gloo
        self.reducing = [_reduction_bytes(u, backend if gloo else "", group_size) for u in others] + [0]
        self.cast = [_cast_bytes(u) for u in others]
        # the backend's scratch appears as the unit's reduction starts (its input is the flat gradient, or the cast)
        self.reducing_scratch = [_reduction_bytes(u, backend, group_size, scratch_only=True) for u in others]
        self.root_scratch = sum(_reduction_bytes(u, backend, group_size, scratch_only=True) for u in roots)
        # A frozen unit's post-backward completes nothing: the reduction in flight is the last trainable unit's.
        self.pending = [0] * (self.n + 1)
        for i in reversed(range(self.n)):
            self.pending[i] = self.reducing[i + 1] if others[i + 1:i + 2] and others[i + 1].trainable_numel \
                else self.pending[i + 1]
        self.trainable = [bool(u.trainable_numel) for u in others]
        self.shard_out = [_shard_output_bytes(u) for u in others]
        self.resharding = any(u.reshard_after_forward for u in others)
        # Across no_sync() micro-batches every unit holds its unsharded gradient (a replicated unit's too).
        self.held = [_unsharded_grad_bytes(u) if no_sync else 0 for u in others]
        self.replicated = [u.replicated for u in others]
        self.root_held = sum(_unsharded_grad_bytes(u) if no_sync else 0 for u in roots)
        self.held_across_no_sync = sum(self.held) + self.root_held
        # See [Note: Small units gathered together] in csrc/flatshard/scheduler.h: a prefetch gathers the run of small
        # units after its own (at most gather_together bytes, 16 units); on two gloo ranks their reduce-scatters wait
        # for each other, each flat gradient held until the run's goes.
        self.gather_together = gather_together
        self.copy_out = [b if u.layout.kind.name == "DIM0" and not u.replicated else 0
                         for u, b in zip(others, self.buffers)]
        deferring = gather_together and gloo and group_size == 2
        self.gathered_ahead = [self._run(self.buffers, i, 1) for i in range(self.n)]
        self.gathered_behind = [self._run(self.buffers, i, -1) for i in range(self.n)]
        if deferring:  # (the units after i in forward order reduce before it in backward)
            self.pending = [p + self._run(self.flat, i + 1, 1, first_alone=False) for i, p in enumerate(self.pending)]
        self.forward = self.root_forward + self._forward_buffers() + self.held_across_no_sync + self.forward_activations

    def _ahead(self, i: int) -> int:
        """In forward, beside unit i's parameters: the next unit's, prefetched after i's wait (and its all-gather's
        temporaries); or, gathered together before it, the run of units after i, while i's wait copies its parameters
        out of its all-gather's buffer (fully_shard's layout: both held for a moment)."""
        if i + 1 >= self.n:
            return 0
        alone = self.buffers[i + 1] + self.copies[i + 1]
        together = self.gathered_ahead[i + 1]
        return max(alone, together + self.copy_out[i]) if together > self.buffers[i + 1] else alone

    def _run(self, sizes: list[int], start: int, step: int, first_alone: bool = True) -> int:
        """Bytes of ``sizes`` from unit ``start`` on (by ``step``) that go in one collective: the first whatever its
        size (``first_alone``), then while the sum fits gather_together (see [Note: Small units gathered together])."""
        total, count, j = 0, 0, start
        while 0 <= j < self.n and count < 16 and not self.replicated[j]:
            if total + sizes[j] > self.gather_together and (count or not first_alone):
                break
            total, count, j = total + sizes[j], count + 1, j + step
        return total

    def _forward_buffers(self) -> int:
        n, b, c = self.n, self.buffers, self.copies
        if not n:
            return 0
        if self.resharding:  # the current unit and the one prefetched (with those gathered together with it)
            return max(b[i] + self._ahead(i) for i in range(n))
        return sum(b) + c[-1]  # every unit stays unsharded from its forward to its backward

    def _backward_points(self, grads_on_device: bool) -> list[tuple[int, int]]:
        """(bytes in flight without activations, activations still held) at each unit's backward (while it computes,
        then at its post-backward), then the root's reduction."""
        n, b, c = self.n, self.buffers, self.copies
        points = []
        for i in range(n):
            prefetched = self.gathered_behind[i - 1] if i and self.resharding else 0
            # the prefetch's temporaries: while its call runs as the unit's backward starts (gloo's: until it completes)
            scratch = c[i - 1] if i and self.resharding else 0
            before = sum(b[:i]) if not self.resharding else prefetched  # the units to come, unsharded
            reduced = sum(self.shards[i + 1:]) if grads_on_device else 0  # units after i reduced already
            # what earlier micro-batches left unreduced (unit i's own gradient accumulates into it)
            held = sum(self.held[:i + 1]) + self.root_held
            # Before the unit's backward, since the last unit's: the root's own (the loss's and the head's, for an LM
            # wrapped by its layers), with the unit gathered (prefetched; the first by the root's pre-backward), not yet
            # the one after it.
            gap_root_grads, gap_acts = self.acts.gaps[i]
            points.append((self.root + gap_root_grads + b[i] + (before if not self.resharding else 0)
                           + self.pending[i] + reduced + held, gap_acts))
            gap_root_grads, gap_acts = self.acts.gaps_ungathered[i]  # (FULL_SHARD's first unit, not yet gathered)
            points.append((self.root + gap_root_grads + (0 if self.resharding else b[i] + before)
                           + self.pending[i] + reduced + held, gap_acts))
            base = self.root + b[i] + before + self.pending[i] + reduced + held
            points.append((base + self.acts.root_at_start[i] + scratch, self.acts.starting[i]))
            grads, acts = self.acts.computing[i]
            points.append((base + self.acts.root_at_start[i] + grads + (scratch if self.copy_outlives_call else 0),
                           acts))
            # post-backward: the previous reduction completed (not by a frozen unit), the parameters resharded, then the
            # flat gradient, its cast, the reduction's output shard and scratch
            post = (self.root + self.acts.root_at_end[i] + before + reduced + held
                    + (scratch if self.copy_outlives_call else 0) + (0 if self.trainable[i] else self.pending[i]))
            if self.trainable[i]:
                post += (max(self.held[i], self.flat[i]) - self.held[i] + self.autograd[i] + self.cast[i]
                         + self.shard_out[i] + self.reducing_scratch[i])
            points.append((post, self.acts.left[i]))
        reduced = sum(self.shards) if grads_on_device else 0
        # the root's post-backward: the last unit's reduction completed, the root resharded, its flat gradient made
        points.append((self.root_post + self.root_scratch + reduced + self.root_held, self.acts.after))
        return points

    def backward(self, grads_on_device: bool) -> int:
        return max(in_flight + acts for in_flight, acts in self._backward_points(grads_on_device))

    def backward_in_flight(self, grads_on_device: bool) -> int:
        return max(self._backward_points(grads_on_device), key=sum)[0]


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


def _grad_shard_bytes(unit: PlannedUnit) -> int:
    return unit.layout.shard_numel * _size(unit.dtype) if unit.trainable_numel else 0


def _unsharded_grad_bytes(unit: PlannedUnit) -> int:
    return unit.layout.padded_numel * _size(unit.param_dtype) if unit.trainable_numel else 0


# gloo's all-reduce (a reduce-scatter on more than two gloo ranks is one, in place) works through a scratch buffer of its
# input's size over the group's size, at most about 2 MB (measured: 1 MB for 4 MB over 4 ranks, 2 MB for 16 MB over 2 or 4
# ranks). Two ranks reduce-scatter by exchanging halves instead, straight into the output (see [Note: Two gloo ranks
# exchange halves] in csrc/flatshard/collectives.cpp): no scratch; a replicated unit's or a trainable prefix's
# all-reduce keeps it.
GLOO_ALL_REDUCE_SCRATCH_CAP = 2_000_000


# torch's fake process group splits a single-tensor collective's buffer into a view per rank while the call runs (measured:
# 516 KB at 1024 ranks, 32 KB at 64).
FAKE_GROUP_BYTES_PER_RANK = 504


def _collective_scratch(backend: str, group_size: int) -> int:
    """What a backend holds besides the buffers while one of flatshard's collectives runs (not gloo's all-gather copy
    nor its all-reduce's scratch, which depend on the buffer)."""
    return FAKE_GROUP_BYTES_PER_RANK * group_size if backend == "fake" and group_size > 1 else 0


def _reduction_bytes(unit: PlannedUnit, backend: str, group_size: int, scratch_only: bool = False) -> int:
    """What a unit's gradient reduction holds while in flight: its input (a replicated unit reduces its gradient
    in place), and the backend's scratch."""
    if not unit.trainable_numel or group_size == 1:
        return 0
    nbytes = unit.layout.padded_numel * _size(unit.reduce_dtype)
    exchanged = group_size == 2 and not (unit.replicated or unit.reduces_prefix)  # (an all-reduce otherwise)
    scratch = ((0 if exchanged else min(nbytes // group_size, GLOO_ALL_REDUCE_SCRATCH_CAP)) if backend == "gloo"
               else _collective_scratch(backend, group_size))
    return (0 if unit.replicated or scratch_only else nbytes) + scratch


def _autograd_grad_bytes(unit: PlannedUnit) -> int:
    """Autograd's gradients of a unit's parameters, held until its post-backward flattens them."""
    return unit.trainable_numel * _size(unit.param_dtype)


def _flat_grad_bytes(unit: PlannedUnit) -> int:
    """The unsharded flat gradient a unit's post-backward makes from autograd's (a replicated unit's becomes its
    shard's gradient)."""
    return 0 if not unit.trainable_numel else unit.layout.padded_numel * _size(unit.param_dtype)


def _shard_output_bytes(unit: PlannedUnit) -> int:
    """The gradient shard a sharded unit's reduction writes (``reduce_dtype``), beside its input."""
    return 0 if unit.replicated or not unit.trainable_numel else unit.layout.shard_numel * _size(unit.reduce_dtype)


def _cast_bytes(unit: PlannedUnit) -> int:
    """The reduction's input, when the gradient is cast to ``reduce_dtype``."""
    if not unit.trainable_numel or unit.reduce_dtype == unit.param_dtype:
        return 0
    return unit.layout.padded_numel * _size(unit.reduce_dtype)
