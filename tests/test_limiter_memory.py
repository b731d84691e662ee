"""The rate limiter bounds unsharded memory: at most N all-gathers in flight.

Acceptance (DESIGN.md mechanism 7): with ``limit_all_gathers=True`` (N =
``FLATSHARD_ALL_GATHER_LIMIT``, default 2) on a model of many units (a GPT of 8
Blocks: 9 units), trained a few steps at world size 2 with forward prefetch and
BACKWARD_PRE, the peak of ``flatshard._C.unsharded_bytes()`` never exceeds
(N + 1) x the largest unit's ``unsharded_nbytes``, and between steps nothing is
unsharded.

The bound is not vacuous: the same model with SHARD_GRAD_OP (every unit stays
unsharded from its forward to its backward) peaks at the sum of all units, about
8 blocks, far above 3; ``test_counter_sees_every_unit`` checks that, so a counter
that missed buffers could not pass the bound by accident.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from _cases import CaseRun
from flatshard.testing import run_distributed
from models import Block, gpt_loss, local_slice, make_batch, make_gpt

WORLD_SIZE = 2
N_LAYERS = 8
STEPS = 3
DEFAULT_LIMIT = 2  # FLATSHARD_ALL_GATHER_LIMIT unset


def _train_and_measure(rank: int, world_size: int, strategy: str) -> dict:
    import os

    from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy

    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import _C

    assert "FLATSHARD_ALL_GATHER_LIMIT" not in os.environ, "the test expects the default limit"
    model = FSDP(
        make_gpt(n_layers=N_LAYERS),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        device_id=torch.device("cpu"),
        sharding_strategy=ShardingStrategy[strategy],
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        forward_prefetch=True,
        limit_all_gathers=True,
    )
    units = [u for u in FSDP.fsdp_modules(model) if u._unit_state.handle is not None]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    batch = local_slice(make_batch(), rank, world_size)
    peaks, between = [], []
    for _ in range(STEPS):
        _C.reset_peak_unsharded_bytes()
        gpt_loss(model, *batch).backward()
        opt.step()
        opt.zero_grad()
        peaks.append(int(_C.peak_unsharded_bytes()))
        between.append(int(_C.unsharded_bytes()))
    return {
        "n_units": len(units),
        "unit_nbytes": [int(u._unit_state.handle.unsharded_nbytes) for u in units],
        "peaks": peaks,
        "between": between,
    }


def _cases_of(world_size: int):
    # One process start for both measurements; FULL_SHARD first (a fresh counter).
    return world_size, [(s, s) for s in ("FULL_SHARD", "SHARD_GRAD_OP")]


# pg_timeout: run_distributed's default collective timeout (CaseRun's is 30 s).
MEASUREMENTS = CaseRun(_train_and_measure, _cases_of, timeout=180.0, pg_timeout=60.0)


def test_peak_unsharded_bytes_bounded_by_limit():
    for rank, r in enumerate(MEASUREMENTS.results(WORLD_SIZE, "FULL_SHARD")):
        assert r["n_units"] == N_LAYERS + 1, f"rank {rank}: expected {N_LAYERS + 1} units, got {r['n_units']}"
        largest = max(r["unit_nbytes"])
        bound = (DEFAULT_LIMIT + 1) * largest
        assert r["between"] == [0] * STEPS, (
            f"rank {rank}: _C.unsharded_bytes() after each step: {r['between']}; expected 0 (nothing unsharded)"
        )
        assert all(p >= largest for p in r["peaks"]), (
            f"rank {rank}: per-step peaks {r['peaks']} below the largest unit ({largest} bytes): the "
            f"counter missed the unsharded buffers"
        )
        assert max(r["peaks"]) <= bound, (
            f"rank {rank}: FULL_SHARD, limit_all_gathers=True (N={DEFAULT_LIMIT}), forward prefetch and "
            f"BACKWARD_PRE: peak unsharded bytes per step {r['peaks']} exceed (N + 1) x largest unit = "
            f"{DEFAULT_LIMIT + 1} x {largest} = {bound} (units: {r['unit_nbytes']})"
        )


def test_counter_sees_every_unit():
    for rank, r in enumerate(MEASUREMENTS.results(WORLD_SIZE, "SHARD_GRAD_OP")):
        total = sum(r["unit_nbytes"])
        largest = max(r["unit_nbytes"])
        assert total > (DEFAULT_LIMIT + 1) * largest, "the model is too small for the bound to mean anything"
        # SHARD_GRAD_OP keeps every unit unsharded from forward to backward: at the end
        # of forward all of them are.
        assert all(p >= total for p in r["peaks"]), (
            f"rank {rank}: SHARD_GRAD_OP peaks {r['peaks']} below the sum of all units ({total} bytes)"
        )
        assert r["between"] == [0] * STEPS, f"rank {rank}: unsharded bytes between steps: {r['between']}"


def _back_to_back_all_gathers(rank: int, world_size: int, limit: str | None) -> dict:
    """Issues three all-gathers back to back while rank 1 holds the first one up.

    With a limit of 1 the second all-gather cannot be issued before the first
    completes, and the first cannot complete before rank 1 joins it: rank 0
    must stall in the limiter, inside a ``flatshard::rate_limit_wait`` range.
    Rank 1 joins once rank 0 is inside the call that issues the second (a thread
    of rank 0 sees its main thread there: the call releases the GIL while it
    waits); without a limit, once rank 0 has issued all three.
    """
    import os
    import sys
    import threading
    import time

    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from flatshard import FullyShardedDataParallel as FSDP

    if limit is None:
        limit_all_gathers = False
    else:
        os.environ["FLATSHARD_ALL_GATHER_LIMIT"] = limit
        limit_all_gathers = True
    model = FSDP(
        make_gpt(n_layers=3),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        device_id=torch.device("cpu"),
        limit_all_gathers=limit_all_gathers,
    )
    with torch.no_grad():
        model(local_slice(make_batch(), rank, world_size)[0])  # lazy init; nothing stays unsharded
    scheduler = model._unit_state.root.scheduler
    handles = [model.module.blocks[i]._unit_state.handle for i in range(3)]
    store = dist.distributed_c10d._get_default_store()
    me = sys._getframe()

    def tell_rank1_once_issuing_the_second():
        main = threading.main_thread().ident
        while True:
            frame = sys._current_frames().get(main)
            if frame is me and frame.f_locals.get("issuing") is handles[1]:
                store.set("rank0_issuing_second", "1")
                return
            time.sleep(0.001)

    before = scheduler.limiter_stalls
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        if rank == 0 and limit is not None:
            threading.Thread(target=tell_rank1_once_issuing_the_second, daemon=True).start()
        if rank == 1:
            store.wait(["rank0_issuing_second" if limit is not None else "rank0_issued_all"])
        for issuing in handles:
            scheduler.unshard(issuing)
        if rank == 0 and limit is None:
            store.set("rank0_issued_all", "1")
        for handle in handles:
            scheduler.wait_for_unshard(handle)
    for handle in handles:
        scheduler.reshard(handle)
    waits = sum(1 for e in prof.events() if e.name == "flatshard::rate_limit_wait")
    return {"stalls": scheduler.limiter_stalls - before, "waits": waits}


def test_limiter_stalls_the_host_and_shows_in_the_trace():
    rank0 = run_distributed(_back_to_back_all_gathers, WORLD_SIZE, "1")[0]
    assert rank0["stalls"] >= 1 and rank0["waits"] >= 1, (
        f"FLATSHARD_ALL_GATHER_LIMIT=1, three all-gathers issued back to back while the peer held "
        f"the first up: rank 0 stalled {rank0['stalls']} time(s) in {rank0['waits']} "
        f"flatshard::rate_limit_wait range(s); expected >= 1 of each"
    )
    unlimited = run_distributed(_back_to_back_all_gathers, WORLD_SIZE, None)[0]
    assert unlimited == {"stalls": 0, "waits": 0}, f"limit_all_gathers=False: {unlimited}"
