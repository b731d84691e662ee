"""A sharded run against a single process on the same global batch: the check every FSDP test needs.

[Note: Comparing with a single process]
Data parallelism is right when W ranks, each on its 1/W of every global batch, train as one
process does on the whole batch: each rank's loss is the mean over its rows, FSDP averages the
gradients over the ranks, so with equal rows per rank the step is the single process's step.
``compare_with_single_process`` runs both inside each rank: the reference (the unsharded model,
every rank alike) on each whole batch, the sharded model (whatever ``shard`` makes of it: torch's
``FullyShardedDataParallel``, torch's ``fully_shard``, flatshard's either, DDP) on this rank's rows,
one optimizer step per batch; then it compares each step's loss (averaged over the ranks) and the
final full parameters. The full parameters are read as users read them, without knowing whose
FSDP it is: FSDP1's class (torch's or a drop-in with its API) through ``state_dict_type``
with ``FULL_STATE_DICT``, DTensors (FSDP2) through ``full_tensor()``, plain tensors as they are.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

__all__ = ["Comparison", "compare_with_single_process"]


@dataclasses.dataclass
class Comparison:
    """What ``compare_with_single_process`` saw (on one rank)."""

    losses: list[float]  # the sharded run's, averaged over the ranks, per step
    reference_losses: list[float]  # the single process's on the whole batch
    max_param_diff: float  # largest absolute difference of any final parameter element
    worst_param: str  # the parameter it is in


def _rows(batch: Any, rank: int, world_size: int) -> Any:
    """This rank's rows of every tensor of ``batch`` (a tensor, or a tuple / list / dict of them)."""
    import torch

    if isinstance(batch, torch.Tensor):
        if batch.shape[0] % world_size:
            raise ValueError(f"compare_with_single_process: a batch of {batch.shape[0]} rows does not split evenly "
                             f"over {world_size} ranks; give each global batch a multiple of {world_size} rows")
        return batch.chunk(world_size)[rank]
    if isinstance(batch, dict):
        return {k: _rows(v, rank, world_size) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_rows(v, rank, world_size) for v in batch)
    return batch


def _full_state(model: Any) -> dict[str, Any]:
    """Every parameter and buffer, whole, under its unsharded name (see the note)."""
    kind = getattr(type(model), "state_dict_type", None)
    if callable(kind):  # FSDP1's class: the full state dict has the unwrapped names
        from torch.distributed.fsdp import StateDictType

        with kind(model, StateDictType.FULL_STATE_DICT):
            state = model.state_dict()
    else:
        state = model.state_dict()
    return {name: (value.full_tensor() if hasattr(value, "full_tensor") else value).detach()
            for name, value in state.items()}


def compare_with_single_process(
    rank: int,
    world_size: int,
    make_model: Callable[[], Any],
    shard: Callable[[Any], Any],
    batches: Sequence[Any],
    loss_fn: Callable[[Any, Any], Any],
    *,
    optimizer: Callable[[Any], Any] | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> Comparison:
    """Inside a rank (``run_distributed`` or a ``world_size``-marked test): trains ``shard(make_model())`` on this
    rank's rows of each of ``batches`` and ``make_model()`` on each whole batch, ``optimizer(parameters)`` (default
    SGD, lr 0.1) stepping after each; raises AssertionError naming the step or parameter where they differ by more
    than ``rtol`` / ``atol`` (``torch.testing.assert_close``'s meaning). See [Note: Comparing with a single
    process].

    ``make_model`` must build the same model on every call and every rank (seed inside it); ``loss_fn(model,
    batch)`` must average over the batch's rows (e.g. ``F.cross_entropy``'s default), so that the ranks' mean is the
    whole batch's. Returns what it compared."""
    import torch
    import torch.distributed as dist

    optimizer = optimizer or (lambda params: torch.optim.SGD(params, lr=0.1))
    reference = make_model()
    sharded = shard(make_model())
    ref_opt, opt = optimizer(reference.parameters()), optimizer(sharded.parameters())
    losses, ref_losses = [], []
    for step, batch in enumerate(batches):
        loss = loss_fn(sharded, _rows(batch, rank, world_size))
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().float().clone()
        if world_size > 1:
            dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
        ref_loss = loss_fn(reference, batch)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=atol,
                               msg=lambda m: f"rank {rank}: the losses per step differ from the single process's "
                                             f"({losses} vs {ref_losses}): {m}")
    got, want = _full_state(sharded), {k: v.detach() for k, v in reference.state_dict().items()}
    unwrapped = {name.removeprefix("module."): value for name, value in got.items()}
    if got.keys() != want.keys() and unwrapped.keys() == want.keys():  # DDP's wrapper
        got = unwrapped
    if got.keys() != want.keys():
        raise AssertionError(f"rank {rank}: the sharded model's state has {sorted(got.keys() - want.keys())} more and "
                             f"{sorted(want.keys() - got.keys())} fewer entries than the single process's")
    worst, diff = "", 0.0
    for name, value in want.items():
        torch.testing.assert_close(got[name].to(value.device), value, rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"rank {rank}: {name} after {len(batches)} steps: {m}")
        if value.is_floating_point() and value.numel():
            d = (got[name].to(value.device) - value).abs().max().item()
            if d >= diff:
                worst, diff = name, d
    return Comparison(losses, ref_losses, diff, worst)
