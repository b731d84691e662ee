"""``flatshard.plan.plan``: what a wrap holds and moves per rank at any world size, before running it.

[Note: Planning]
A plan is made from a model on the meta device (nothing is allocated) and the wrap's
arguments, by the same code the constructor runs: the auto-wrap plan, each unit's
parameters, the runtime's own ``FlatParamLayout`` (padding to the shard factor included) and
the mixed-precision dtypes (see ``_units.py``). From those it reports per unit the input bytes
of each collective of one training step, exact (``_costs.py``, [Note: What a step moves];
the runtime counts the same bytes, ``_C.FlatParamHandle.collective_bytes``), and per rank the
memory flatshard holds (``_costs.py``, [Note: What a rank holds]). ``python -m
flatshard.plan`` does this from an HF config. (``flatshard.plan`` is the package, callable: see
``_CallablePackage`` in plan/__init__.py.)

[Note: A fully_shard plan]
``plan(model, W, api="fully_shard", auto_wrap_policy=..., ...)`` plans what ``fully_shard`` called on each
module the policy picks (bottom-up, as FSDP2 users call it on each block), then on the root, holds and moves:
the same units, with FSDP2's dim-0 layout (each parameter padded to whole rows per rank, so the shards differ from
the class's flat ones), ``mixed_precision`` given as torch's ``MixedPrecisionPolicy`` (reduced in
``reduce_dtype``, else ``param_dtype``), ``cpu_offload`` as ``CPUOffloadPolicy``, a 2-D mesh as
``sharding_strategy=HYBRID_SHARD`` (replicated over hosts of ``ranks_per_host``), ``reshard_after_forward``
True, False or None (the root keeping its parameters after forward unless it is True), and only the trainable
parameters' rows reduce-scattered where some are frozen. An int ``reshard_after_forward`` is refused: what a unit
keeps between its forward and backward is not in the timeline yet.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterable

from torch import nn

from flatshard.api import CPUOffload, MixedPrecision, ShardingStrategy
from flatshard.plan._activations import ActivationProfile, measure_activations, profile_activations
from flatshard.plan._costs import RankMemory, UnitTraffic, rank_memory, unit_traffic
from flatshard.plan._timing import INFINIBAND, NETWORKS, NVLINK, Network, StepTime, measure_compute, step_time
from flatshard.plan._units import PlannedUnit, planned_units

__all__ = ["INFINIBAND", "NVLINK", "ActivationProfile", "Network", "Plan", "StepTime", "measure_activations",
           "measure_compute", "plan", "profile_activations"]

_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


@dataclasses.dataclass
class Plan:
    """The outcome of ``plan``: per unit and per rank (bytes)."""

    world_size: int
    sharding_strategy: ShardingStrategy
    shard_group_size: int
    replicate_group_size: int
    units: list[PlannedUnit]
    traffic: list[UnitTraffic]  # per unit, one step
    memory: RankMemory
    timing: StepTime | None = None  # with a network (and the measured compute)

    @property
    def total_numel(self) -> int:
        return sum(u.numel for u in self.units)

    def step_bytes(self) -> dict[str, int]:
        """Input bytes of one step's collectives per kind, summed over units (per rank)."""
        out: dict[str, int] = {}
        for traffic in self.traffic:
            for kind, n in traffic.as_dict().items():
                out[kind] = out.get(kind, 0) + n
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "sharding_strategy": self.sharding_strategy.name,
            "shard_group_size": self.shard_group_size,
            "replicate_group_size": self.replicate_group_size,
            "parameters": self.total_numel,
            "units": [
                {"name": u.name or "<root>", "numel": u.numel, "padded_numel": u.layout.padded_numel,
                 "shard_numel": u.layout.shard_numel, "param_dtype": str(u.param_dtype).removeprefix("torch."),
                 "reduce_dtype": str(u.reduce_dtype).removeprefix("torch."), "collective_bytes": t.as_dict()}
                for u, t in zip(self.units, self.traffic)
            ],
            "step_collective_bytes": self.step_bytes(),
            "memory_per_rank": self.memory.as_dict(),
            "step_time": None if self.timing is None else self.timing.as_dict(),
        }

    def table(self) -> str:
        """A terminal table: memory per rank, then bytes per unit (identical units folded into one row)."""
        gib = 1024 ** 3
        m = self.memory
        lines = [
            f"flatshard plan: {self.total_numel / 1e9:.3f} B parameters, {len(self.units)} units, "
            f"{self.sharding_strategy.name} at world size {self.world_size} "
            f"(shard groups of {self.shard_group_size}, replicated {self.replicate_group_size}x)",
            "",
            "memory per rank                      GiB",
            f"  sharded parameters         {m.sharded_params / gib:12.3f}",
            f"  gradients (sharded)        {m.gradients / gib:12.3f}",
            f"  optimizer state            {m.optimizer_state / gib:12.3f}",
            f"    of which on the host     {m.on_host / gib:12.3f}",
            f"  in flight, forward worst   {m.forward_in_flight / gib:12.3f}",
            f"  in flight, backward worst  {m.backward_in_flight / gib:12.3f}",
            f"  optimizer step temporaries {m.optimizer_step / gib:12.3f}",
        ]
        if m.no_sync_gradients:
            lines.append(f"    held across no_sync()    {m.no_sync_gradients / gib:12.3f}")
        lines.append(f"  activations                "
                     + ("not measured (give a batch: --batch-size and --seq-len, or activation_bytes=)" if m.activations is None else f"{m.activations / gib:12.3f}"))
        lines.append(f"  device peak                {m.device_peak / gib:12.3f}")
        if m.on_host:
            lines.append(f"  device and host together   {m.combined_peak / gib:12.3f}")
        lines += ["", "collective input bytes per step, per rank (MiB)",
                  f"  {'unit':<28}{'x':>4}{'all_gather':>14}{'reduce_scatter':>16}{'all_reduce':>12}{'replica':>10}"]
        rows: list[tuple[str, int, dict[str, int]]] = []
        for u, t in zip(self.units, self.traffic):
            label = _fold(u.name)
            if rows and rows[-1][0] == label and rows[-1][2] == t.as_dict():
                rows[-1] = (label, rows[-1][1] + 1, rows[-1][2])
            else:
                rows.append((label, 1, t.as_dict()))
        mib = 1024 ** 2
        for label, count, b in rows:
            lines.append(f"  {label:<28}{count:>4}{b['all_gather'] / mib:14.2f}{b['reduce_scatter'] / mib:16.2f}"
                         f"{b['all_reduce'] / mib:12.2f}{b['replica_all_reduce'] / mib:10.2f}")
        total = self.step_bytes()
        lines.append(f"  {'total':<32}{total['all_gather'] / mib:14.2f}{total['reduce_scatter'] / mib:16.2f}"
                     f"{total['all_reduce'] / mib:12.2f}{total['replica_all_reduce'] / mib:10.2f}")
        if self.timing is not None:
            t, ms = self.timing, 1e3
            lines += ["", f"one step's time (ms), {t.network}, collectives {'overlapping' if t.overlap else 'after'} "
                          f"the compute",
                      f"  compute (measured)         {t.compute * ms:12.2f}" + ("  (not given)" if not t.compute else ""),
                      f"  collectives                {t.communication * ms:12.2f}   "
                      + ", ".join(f"{k} {v * ms:.2f}" for k, v in sorted(t.per_kind.items())),
                      f"  exposed communication      {t.exposed_communication * ms:12.2f}",
                      f"  step                       {t.step * ms:12.2f}"]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)


def _fold(name: str) -> str:
    """``model.layers.17`` -> ``model.layers.*`` (identical layers fold into one row)."""
    parts = ["*" if part.isdigit() else part for part in name.split(".")] if name else ["<root>"]
    return ".".join(parts)


def plan(
    model: nn.Module,
    world_size: int,
    *,
    auto_wrap_policy: Any = None,
    sharding_strategy: ShardingStrategy | None = None,
    mixed_precision: MixedPrecision | None = None,
    cpu_offload: CPUOffload | None = None,
    use_orig_params: bool = False,
    ignored_modules: Iterable[nn.Module] = (),
    optimizer: str = "adamw",
    ranks_per_host: int = 8,
    no_sync: bool = False,
    activation_bytes: int | ActivationProfile | None = None,
    optimizer_foreach: bool = True,
    backend: str = "nccl",
    device: str = "cuda",
    network: Network | str | None = None,
    compute: tuple[float, float, float] | None = None,
    overlap: bool | None = None,
    api: str = "class",
    reshard_after_forward: bool | None = None,
) -> Plan:
    """What ``FullyShardedDataParallel(model, ...)`` at ``world_size`` ranks holds and moves per rank (see
    [Note: Planning]). ``model`` may be on the meta device. Hybrid strategies shard within groups of
    ``ranks_per_host`` (flatshard's default: the ranks of a host). ``optimizer``: "adamw", "adam", "sgd",
    "sgd_momentum" or "none". ``no_sync``: the memory of accumulating with ``no_sync()``.
    ``activation_bytes``: what a forward and backward of the unwrapped model on one rank's batch holds beyond
    its parameters and gradients, if measured (else left out): ``measure_activations``'s number (held whole
    through forward, spread evenly over the units' backward) or ``profile_activations``'s profile (held where the
    measured step held it, [Note: Activations unit by unit]).
    ``optimizer_foreach``: whether the optimizer steps every tensor at once (torch's default on GPUs) or one at a
    time (on CPUs). ``backend``: "nccl", "gloo" (whose collectives hold temporaries while they run) or "fake" (torch's fake
    process group: every collective completes at once).
    ``device``: "cuda" or "cpu" (training on the host itself: offloaded shards are used where they are).
    ``network`` ("nvlink", "infiniband" or a ``Network``) and ``compute`` (seconds of the forward, backward and
    optimizer step of one rank's batch, ``measure_compute``): one step's time (see [Note: The timing model]);
    ``overlap``: whether collectives overlap the compute (default: on "cuda").
    ``api``: "class" (``FullyShardedDataParallel``) or "fully_shard" (see [Note: A fully_shard plan]), whose
    ``reshard_after_forward`` is FSDP2's argument."""
    if api not in ("class", "fully_shard"):
        raise ValueError(f"flatshard.plan: api: expected 'class' or 'fully_shard' but got {api!r}")
    if api == "fully_shard":
        sharding_strategy, mixed_precision, cpu_offload = _as_fully_shard(
            sharding_strategy, reshard_after_forward, mixed_precision, cpu_offload, use_orig_params)
    elif reshard_after_forward is not None:
        raise ValueError("flatshard.plan: reshard_after_forward is fully_shard's argument (api='fully_shard'); the "
                         "class's is sharding_strategy (FULL_SHARD or SHARD_GRAD_OP)")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"flatshard.plan: device: expected 'cuda' or 'cpu' but got {device!r}")
    if backend not in ("nccl", "gloo", "fake"):
        raise ValueError(f"flatshard.plan: backend: expected 'nccl', 'gloo' or 'fake' but got {backend!r}")
    if world_size < 1:
        raise ValueError(f"flatshard.plan: world_size: expected >= 1 but got {world_size}")
    strategy = ShardingStrategy.FULL_SHARD if sharding_strategy is None else sharding_strategy
    if strategy in _HYBRID:
        if world_size % ranks_per_host:
            raise ValueError(f"flatshard.plan: hybrid sharding: expected the world size {world_size} to be a multiple "
                             f"of ranks_per_host ({ranks_per_host})")
        shard_group, replicate_group = ranks_per_host, world_size // ranks_per_host
    else:
        shard_group, replicate_group = world_size, 1
    offload = bool(cpu_offload is not None and cpu_offload.offload_params)
    shard_factor = 1 if strategy == ShardingStrategy.NO_SHARD else shard_group
    units = planned_units(model, shard_factor, strategy, auto_wrap_policy, mixed_precision, offload,
                          use_orig_params or api == "fully_shard", ignored_modules, fully_shard=api == "fully_shard",
                          root_reshards_after_forward=reshard_after_forward is True)
    traffic = [unit_traffic(u, shard_group, replicate_group) for u in units]
    memory = rank_memory(units, optimizer, offload, no_sync, activation_bytes, optimizer_foreach, backend,
                         compute_on_host=device == "cpu", shard_group_size=shard_group,
                         new_groups=2 if strategy in _HYBRID else 0,
                         gather_together=_gather_together(api, device))
    timing = None
    if network is not None:
        if isinstance(network, str):
            if network not in NETWORKS:
                raise ValueError(f"flatshard.plan: network: expected one of {sorted(NETWORKS)} or a Network but got "
                                 f"{network!r}")
            network = NETWORKS[network]
        timing = step_time(units, shard_group, replicate_group, network, compute or (0.0, 0.0, 0.0),
                           overlap=device == "cuda" if overlap is None else overlap, gloo=backend == "gloo")
    return Plan(world_size, strategy, shard_group, replicate_group, units, traffic, memory, timing)


def _gather_together(api: str, device: str) -> int:
    """What fully_shard gathers together on ``device`` (see [Note: fully_shard gathers small units together])."""
    if api != "fully_shard":
        return 0
    from flatshard._fsdp2_config import gather_together_bytes

    return gather_together_bytes("cuda" if device == "cuda" else "cpu")


def _as_fully_shard(strategy: ShardingStrategy | None, reshard_after_forward: Any, mixed_precision: Any,
                    cpu_offload: Any, use_orig_params: bool) -> tuple[ShardingStrategy, Any, Any]:
    """fully_shard's arguments as the runtime's strategy, MixedPrecision and CPUOffload (see [Note: A fully_shard
    plan])."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    from flatshard._fsdp2_config import _mixed_precision

    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise NotImplementedError(f"flatshard.plan: reshard_after_forward={reshard_after_forward!r}: an int is not "
                                  f"planned yet (what a unit keeps between its forward and backward); plan True or "
                                  f"False")
    if strategy not in (None, ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD):
        raise ValueError(f"flatshard.plan: api='fully_shard' takes sharding_strategy None, FULL_SHARD (a 1-D mesh) or "
                         f"HYBRID_SHARD (a 2-D mesh) but got {strategy.name}; resharding is reshard_after_forward")
    if use_orig_params:
        raise ValueError("flatshard.plan: use_orig_params is the class's argument; fully_shard's parameters are "
                         "always the original ones")
    hybrid = strategy == ShardingStrategy.HYBRID_SHARD
    keeps = reshard_after_forward is False
    strategy = {(False, False): ShardingStrategy.FULL_SHARD, (False, True): ShardingStrategy.SHARD_GRAD_OP,
                (True, False): ShardingStrategy.HYBRID_SHARD,
                (True, True): ShardingStrategy._HYBRID_SHARD_ZERO2}[(hybrid, keeps)]
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecisionPolicy):
        raise TypeError(f"flatshard.plan: api='fully_shard' takes mixed_precision as torch's MixedPrecisionPolicy but "
                        f"got {type(mixed_precision).__name__}")
    if cpu_offload is not None and not isinstance(cpu_offload, OffloadPolicy):
        raise TypeError(f"flatshard.plan: api='fully_shard' takes cpu_offload as torch's CPUOffloadPolicy (or "
                        f"OffloadPolicy) but got {type(cpu_offload).__name__}")
    mp = None if mixed_precision is None else _mixed_precision(mixed_precision)
    offload = CPUOffload(offload_params=True) if isinstance(cpu_offload, CPUOffloadPolicy) else None
    return strategy, mp, offload
