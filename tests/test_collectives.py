"""The scheduler's collectives on gloo: results, and when their buffers go.

See [Note: gloo's temporaries] in csrc/flatshard/collectives.cpp: on gloo a
reduction's input (the unit's unsharded flat gradient) must be freed when the
collective completes, on gloo's thread, not when the host next waits, so that
it is not held across the next unit's backward.
"""

import time
import weakref

import pytest
import torch
import torch.distributed as dist

from flatshard.testing import run_distributed

SHAPES = [[64, 32], [32], [7]]  # 2087 elements: padded to an even split at W=2


def _unit(rank: int, world_size: int):
    from flatshard import _C

    layout = _C.FlatParamLayout(SHAPES, world_size)
    params = [torch.zeros(s) for s in SHAPES]
    return _C.FlatParamHandle("probe", layout, rank, params, predivide=float(world_size)), layout  # the average over W


def _grads(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def _expected_shard(layout, rank: int, world_size: int) -> torch.Tensor:
    mean = [sum(_grads(r)[i] for r in range(world_size)) / world_size for i in range(len(SHAPES))]
    flat = torch.cat([g.reshape(-1) for g in mean])
    flat = torch.cat([flat, flat.new_zeros(layout.padding_numel)])
    return flat.chunk(world_size)[rank]


def _reduction_input_freed_at_completion(rank: int, world_size: int) -> dict:
    from flatshard import _C

    unit, layout = _unit(rank, world_size)
    scheduler = _C.Scheduler(dist.group.WORLD, None, torch.device("cpu"), 2)
    unit.accumulate_grad(_grads(rank))
    flat_grad = weakref.ref(unit.unsharded_grad)  # dies with the C++ tensor (PyObject preservation)
    assert flat_grad() is not None
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:  # joins only once rank 0 has looked: rank 0's collective cannot have completed before
        store.wait(["rank0_issued"])
    scheduler.reduce_grad(unit)
    alive_right_after_issue = flat_grad() is not None
    if rank == 0:
        store.set("rank0_issued", "1")
    # The host does not wait on the scheduler: gloo's thread frees the input once the collective completes. The
    # deadline only bounds a failure (the input never freed), generously: a loaded machine may be slow to do it.
    deadline = time.monotonic() + 60.0
    while flat_grad() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    freed_without_host_wait = flat_grad() is None
    pending_before_finish = scheduler.pending_reductions
    scheduler.finish_grad_sync()
    grad = unit.local_shard.grad
    expected = _expected_shard(layout, rank, world_size)
    torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-7)
    return {
        "alive_right_after_issue": alive_right_after_issue,
        "freed_without_host_wait": freed_without_host_wait,
        "pending_before_finish": pending_before_finish,
    }


def test_reduction_input_freed_when_gloo_completes():
    results = run_distributed(_reduction_input_freed_at_completion, 2, timeout=60.0)
    # Rank 0 looked before its peer joined the collective: still held then.
    assert results[0]["alive_right_after_issue"]
    for r in results:
        assert r["freed_without_host_wait"], r
        assert r["pending_before_finish"] == 1, r  # freed by the collective, not by a host-side completion


def _all_gather_and_all_reduce(rank: int, world_size: int) -> None:
    from flatshard import _C

    unit, layout = _unit(rank, world_size)
    shard = torch.arange(layout.shard_numel, dtype=torch.float32) + 1000 * rank
    with torch.no_grad():
        unit.local_shard.copy_(shard)
    scheduler = _C.Scheduler(dist.group.WORLD, None, torch.device("cpu"), 2)
    scheduler.unshard(unit)
    scheduler.wait_for_unshard(unit)
    expected = torch.cat([torch.arange(layout.shard_numel, dtype=torch.float32) + 1000 * r
                          for r in range(world_size)])
    torch.testing.assert_close(unit.unsharded, expected, rtol=0, atol=0)
    scheduler.reshard(unit)
    assert not unit.has_unsharded_storage()


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_gather_on_gloo(world_size):
    run_distributed(_all_gather_and_all_reduce, world_size, timeout=60.0)


def _failed_reduction_raises(rank: int, world_size: int) -> str:
    from flatshard import _C

    unit, _ = _unit(rank, world_size)
    scheduler = _C.Scheduler(dist.group.WORLD, None, torch.device("cpu"), 2)
    unit.accumulate_grad(_grads(rank))
    dist.barrier()
    if rank == 1:
        dist.destroy_process_group()  # never joins the reduction: rank 0's must fail, not pass
        return "left"
    scheduler.reduce_grad(unit)
    try:
        scheduler.finish_grad_sync()
    except RuntimeError as e:
        message = str(e)
    else:
        raise AssertionError("a reduce-scatter whose peer never joined completed without an error")
    assert unit.local_shard.grad is None  # nothing half-reduced reached .grad
    dist.destroy_process_group()
    return message


def test_failed_reduction_raises_on_wait():
    results = run_distributed(_failed_reduction_raises, 2, timeout=60.0, pg_timeout=3.0)
    assert results[1] == "left"
    assert "flatshard: the gradient reduction of unit 'probe' failed" in results[0], results[0]
