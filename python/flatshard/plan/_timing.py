"""How long one training step's collectives take, and how much of it the compute does not hide.

[Note: The timing model]
A collective over a group of ``g`` ranks is modelled as a ring, as NCCL's own tuning model
does: a fixed latency per collective, a latency per ring step, and the bytes each rank sends
over the bandwidth it gets (``Network.bandwidth``, the bus bandwidth nccl-tests reports):
- all-gather of a shard of ``s`` bytes: ``g - 1`` steps, ``(g - 1) * s`` bytes sent;
- reduce-scatter of an input of ``S`` bytes: ``g - 1`` steps, ``(g - 1) / g * S`` sent;
- all-reduce of ``S`` bytes: twice both (on gloo a reduce-scatter is one, in place:
  [Note: gloo's temporaries]).
Each unit's collectives are those of [Note: What a step moves]. The compute of a step (forward,
backward and the optimizer's step, measured on the model unwrapped: ``measure_compute``) is
split over the units by their parameters' share, the forward's in forward order, the
backward's in reverse. Then one step is played on two queues:
- ``overlap=True`` (GPUs: collectives on their own streams): one compute queue, one
  communication queue; a unit's all-gather is issued when the previous unit starts computing
  (the prefetch; the first at once), its compute waits for it; in backward a unit's
  reduction is issued when its backward ends, and the step ends when both queues are done,
  then the optimizer steps;
- ``overlap=False`` (a CPU: the same cores run the collectives, gloo's threads copy and sum
  what they move): the collectives add to the compute. Where the network is a loopback on the
  cores the ranks compute on, a core per rank (``Network.transfer_on_compute_cores``: gloo on
  a CPU with no more ranks than cores), the kernel copies every byte on a rank's own core while
  the rank computes or waits: the bytes part of every collective is paid once more, as compute
  (measured: with W = 2 on two cores the wrapped step's training thread spends 12 ms more on
  its core than the unwrapped one's, about the bytes' time; with more ranks than cores the
  compute and the collectives are measured sharing the cores, all ranks at once, which
  already holds it).
The optimizer's step is scaled to the elements it steps: the rank's shards.
The rank guard's two exchanges per step, before the forward and the backward, are log2(W)
rounds each of a two-rank swap of 128 bytes (two more when W is not a power of two: [Note: The
guard's exchange in log W rounds]), each round a round trip over the guard's own links ([Note:
The guard's links]), modelled as a two-rank collective of the network (an upper bound: no
backend's queue between the training threads). Exposed communication is the step
less the compute. Defaults: ``NVLINK`` and ``INFINIBAND``
below, with their sources; ``Network(...)`` for your own (or measured: ``benchmarks/plan_timing.py``
fits gloo's on this machine).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

import torch
from torch import nn

from flatshard.plan._costs import _trainable_prefix
from flatshard.plan._units import PlannedUnit


@dataclasses.dataclass(frozen=True)
class Network:
    """A ring's cost: ``latency`` seconds per collective, ``step_latency`` per ring step, ``bandwidth`` bytes per
    second each rank sends."""

    name: str
    bandwidth: float
    latency: float = 0.0
    step_latency: float = 0.0
    source: str = ""
    # A loopback network on the cores the ranks compute on, one core per rank (gloo on a CPU): the kernel copies every
    # byte on a rank's own core, so a collective's transfer costs the compute that time as well (see [Note: The timing
    # model]).
    transfer_on_compute_cores: bool = False

    def __post_init__(self) -> None:
        if not self.bandwidth > 0 or self.latency < 0 or self.step_latency < 0:
            raise ValueError(f"flatshard.plan.Network {self.name!r}: expected a positive bandwidth and latencies >= 0 "
                             f"but got bandwidth={self.bandwidth}, latency={self.latency}, "
                             f"step_latency={self.step_latency}")


# NCCL's tuning model (src/graph/tuning.cc): ring, Simple protocol, 8.4 us per collective; 3.4 us per step over
# NVLink, 14 us over the network. Bandwidth: H100 SXM's NVLink 4 carries 450 GB/s each way (NVIDIA's datasheet:
# 900 GB/s bidirectional), of which NCCL's rings reach about 80% in nccl-tests; InfiniBand NDR is 400 Gb/s (50 GB/s)
# per GPU's NIC, about 90% reached.
NVLINK = Network("nvlink", 360e9, 8.4e-6, 3.4e-6, "H100 SXM NVLink 4 (450 GB/s each way, ~80% reached); NCCL ring latencies")
INFINIBAND = Network("infiniband", 45e9, 8.4e-6, 14e-6, "InfiniBand NDR, one 400 Gb/s NIC per GPU (~90% reached); NCCL ring latencies")
NETWORKS = {"nvlink": NVLINK, "infiniband": INFINIBAND}


def collective_seconds(kind: str, nbytes: int, group: int, network: Network) -> float:
    """One collective's time (see [Note: The timing model]); ``nbytes``: its input (an all-gather's shard)."""
    if group <= 1 or nbytes == 0:
        return 0.0
    steps, sent = {
        "all_gather": (group - 1, (group - 1) * nbytes),
        "reduce_scatter": (group - 1, (group - 1) / group * nbytes),
        "all_reduce": (2 * (group - 1), 2 * (group - 1) / group * nbytes),
    }[kind]
    return network.latency + steps * network.step_latency + sent / network.bandwidth


GUARD_BYTES = 128  # what each rank sends in a round of the rank guard's exchange (its minimum and maximum vectors)


def _guard_rounds(world: int) -> int:
    """Rounds of one exchange of the rank guard (see [Note: The guard's exchange in log W rounds])."""
    if world <= 1:
        return 0
    m = 1 << (world.bit_length() - 1)  # the largest power of two <= world
    return m.bit_length() - 1 + (2 if m != world else 0)


@dataclasses.dataclass
class StepTime:
    """One step's time (seconds): compute, every collective's time, and what the compute did not hide."""

    compute: float
    communication: float
    exposed_communication: float
    step: float
    per_kind: dict[str, float]
    network: str
    overlap: bool

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class _UnitCollectives:
    gathers: list[float]  # before forward, before backward (if regathered)
    reduction: float  # after backward (its reduce-scatter or all-reduce, then the replica all-reduce)


def _unit_collectives(unit: PlannedUnit, shard_group: int, replicate_group: int, network: Network, gloo: bool,
                      per_kind: dict[str, float]) -> _UnitCollectives:
    size = torch.empty(0, dtype=unit.param_dtype).element_size()
    reduce_size = torch.empty(0, dtype=unit.reduce_dtype).element_size()
    layout = unit.layout

    def add(kind: str, nbytes: int, group: int) -> float:
        seconds = collective_seconds(kind, nbytes, group, network)
        per_kind[kind] = per_kind.get(kind, 0.0) + seconds
        return seconds

    if unit.replicated:
        reduce = add("all_reduce", layout.padded_numel * reduce_size, shard_group) if unit.trainable_numel else 0.0
        return _UnitCollectives([], reduce)
    gathers = [add("all_gather", layout.shard_numel * size, shard_group)
               for _ in range(1 + (unit.reshard_after_forward and not unit.is_root))]
    reduction = 0.0
    if unit.trainable_numel:
        if unit.reduces_prefix:
            reduction = add("all_reduce", _trainable_prefix(unit) * reduce_size, shard_group)
        else:
            reduction = add("all_reduce" if gloo else "reduce_scatter", layout.padded_numel * reduce_size, shard_group)
        if replicate_group > 1:
            reduction += add("all_reduce", layout.shard_numel * reduce_size, replicate_group)
    return _UnitCollectives(gathers, reduction)


def step_time(units: list[PlannedUnit], shard_group: int, replicate_group: int, network: Network,
              compute: tuple[float, float, float], *, overlap: bool, gloo: bool = False) -> StepTime:
    """``compute``: seconds of (forward, backward, optimizer step) of the whole model on one rank's batch."""
    forward, backward, optimizer = compute
    per_kind: dict[str, float] = {}
    collectives = [_unit_collectives(u, shard_group, replicate_group, network, gloo, per_kind) for u in units]
    if network.transfer_on_compute_cores:
        per_kind["transfer_on_compute_cores"] = _transfer_seconds(units, shard_group, replicate_group, network, gloo)
    world = shard_group * replicate_group
    guard = 2 * _guard_rounds(world) * collective_seconds("all_gather", GUARD_BYTES, 2, network)
    if guard:
        per_kind["rank_guard"] = guard
    communication = sum(per_kind.values())
    # The optimizer steps the rank's shards only.
    optimizer *= sum(u.layout.shard_numel for u in units if u.trainable_numel) / max(
        1, sum(u.numel for u in units if u.trainable_numel))
    total_compute = forward + backward + optimizer
    if not overlap:
        step = total_compute + communication
    else:  # (the bytes' time on the compute's cores is compute: it overlaps nothing)
        step = (_played(units, collectives, forward, backward) + guard + optimizer
                + per_kind.get("transfer_on_compute_cores", 0.0))
    return StepTime(compute=total_compute, communication=communication,
                    exposed_communication=max(0.0, step - total_compute), step=step, per_kind=per_kind,
                    network=network.name, overlap=overlap)


def _transfer_seconds(units: list[PlannedUnit], shard_group: int, replicate_group: int, network: Network,
                      gloo: bool) -> float:
    """The bytes part of every collective of a step (no latencies): what the kernel's copies take from the compute
    when the network is the compute's own cores (``Network.transfer_on_compute_cores``)."""
    bytes_only = dataclasses.replace(network, latency=0.0, step_latency=0.0, transfer_on_compute_cores=False)
    per_kind: dict[str, float] = {}
    for unit in units:
        _unit_collectives(unit, shard_group, replicate_group, bytes_only, gloo, per_kind)
    return sum(per_kind.values())


def _played(units: list[PlannedUnit], collectives: list[_UnitCollectives], forward: float, backward: float) -> float:
    """Forward and backward on a compute queue and a communication queue (see [Note: The timing model])."""
    total = sum(u.numel for u in units) or 1
    share = [u.numel / total for u in units]
    comm_free = 0.0  # when the communication queue is next free
    compute_end = 0.0
    issue = 0.0  # when the next all-gather may be issued (the previous unit's compute start)
    for unit, c, part in zip(units, collectives, share):  # units in forward order, the root first
        ready = issue
        if c.gathers:
            comm_free = max(comm_free, issue) + c.gathers[0]
            ready = comm_free
        start = max(compute_end, ready)
        issue = start
        compute_end = start + forward * part
    for unit, c, part in reversed(list(zip(units, collectives, share))):
        ready = issue
        if len(c.gathers) > 1:
            comm_free = max(comm_free, issue) + c.gathers[1]
            ready = comm_free
        start = max(compute_end, ready)
        issue = start
        compute_end = start + backward * part
        if c.reduction:
            comm_free = max(comm_free, compute_end) + c.reduction
    return max(compute_end, comm_free)


def measure_compute(model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor],
                    optimizer: torch.optim.Optimizer | None = None, repeats: int = 5) -> tuple[float, float, float]:
    """Seconds of the forward, the backward and the optimizer's step of ``model`` (unwrapped, as it is) on one
    rank's batch (``loss_fn(model)``), each the median of ``repeats`` steps after a first; the optimizer's step is
    0 without one. On CUDA the device is synchronized around each part."""
    device = next(model.parameters()).device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    parts: list[tuple[float, float, float]] = []
    for i in range(repeats + 1):
        sync()
        t0 = time.perf_counter()
        loss = loss_fn(model)
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        if optimizer is not None:
            optimizer.step()
        sync()
        t3 = time.perf_counter()
        (optimizer.zero_grad if optimizer is not None else model.zero_grad)(set_to_none=True)
        if i:
            parts.append((t1 - t0, t2 - t1, t3 - t2))
    return tuple(statistics.median(p[k] for p in parts) for k in range(3))  # type: ignore[return-value]
