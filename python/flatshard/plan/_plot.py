"""The plan's plot: memory per rank against world size for each strategy, and bytes per unit."""

from __future__ import annotations

from typing import Callable

from flatshard.api import ShardingStrategy


def plot(make_plan: Callable[[int, ShardingStrategy], object], world_sizes: list[int], path: str) -> None:
    """Writes ``path`` (PNG or PDF): left, each strategy's device peak per rank over ``world_sizes``
    (``make_plan(world_size, strategy)`` gives the plan); right, one step's collective bytes per unit at
    the largest world size with FULL_SHARD. Needs matplotlib (``pip install matplotlib``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("flatshard.plan: --plot needs matplotlib: pip install matplotlib") from e
    gib = 1024 ** 3
    strategies = [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD,
                  ShardingStrategy.HYBRID_SHARD]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for strategy in strategies:
        points = []
        for w in world_sizes:
            try:
                points.append((w, make_plan(w, strategy).memory.device_peak / gib))
            except ValueError:  # hybrid at a world size its groups do not divide
                continue
        if points:
            left.plot(*zip(*points), marker="o", label=strategy.name)
    left.set(xscale="log", xlabel="world size", ylabel="GiB per rank (flatshard's, no activations)",
             title="Memory per rank")
    left.set_xticks(world_sizes, [str(w) for w in world_sizes])
    left.minorticks_off()
    left.legend()
    last = make_plan(max(world_sizes), ShardingStrategy.FULL_SHARD)
    names = [u.name or "<root>" for u in last.units]
    mib = 1024 ** 2
    bottom = [0.0] * len(names)
    for kind in ("all_gather", "reduce_scatter", "all_reduce", "replica_all_reduce"):
        values = [t.as_dict()[kind] / mib for t in last.traffic]
        if any(values):
            right.bar(range(len(names)), values, bottom=bottom, label=kind)
            bottom = [b + v for b, v in zip(bottom, values)]
    right.set(xlabel="unit", ylabel="MiB per step per rank",
              title=f"Collective bytes per unit (FULL_SHARD, W={max(world_sizes)})")
    right.set_xticks(range(len(names)), names, rotation=90, fontsize=6)
    right.legend()
    fig.tight_layout()
    fig.savefig(path)
