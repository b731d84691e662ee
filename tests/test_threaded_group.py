"""Both front-ends on torch's threaded test process group (ranks as threads of one process).

torch's own FSDP tests run many cases on ``ProcessLocalGroup`` (``FSDPTestMultiThread``), a process
group written in Python with no c10d backend; see [Note: A group without c10d backends] in
collectives.cpp for how flatshard's collectives reach it. The oracle is a single-process run on the
same global batch (rtol 1e-6: the two ranks' gradients are summed in another order).
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from flatshard.testing import run_distributed

WORLD = 2
STEPS = 2
_INIT_LOCK = threading.Lock()  # torch's default generator is the process's: one thread seeds and draws at a time


def _model() -> nn.Module:
    torch.manual_seed(0)
    # 7 rows: a dim 0 that does not divide by the world size, so the shards are padded.
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3), nn.Sequential(nn.Linear(3, 3)))


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(WORLD * 4, 5, generator=g) for _ in range(STEPS)]


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x in _batches():
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_rank(rank: int, api: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    import flatshard

    with _INIT_LOCK:
        model = _model()
    if api == "fully_shard":
        for block in (model[0], model[2], model[3]):
            flatshard.fully_shard(block)
        flatshard.fully_shard(model)
    else:
        model = flatshard.FullyShardedDataParallel(
            model, auto_wrap_policy=flatshard.wrap.ModuleWrapPolicy({nn.Linear}), use_orig_params=True
        )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x in _batches():
        local = x.chunk(WORLD)[rank]
        loss = model(local).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / WORLD)
    if api == "fully_shard":
        state = {k: v.full_tensor() for k, v in model.state_dict().items()}
    else:
        with flatshard.FullyShardedDataParallel.state_dict_type(model, flatshard.StateDictType.FULL_STATE_DICT):
            state = model.state_dict()
    return losses, {k: v.detach().clone() for k, v in state.items()}


def _threaded_run(_rank: int, _world: int, api: str):
    """In a process of its own: the gloo group goes, torch's threaded group comes, two threads train."""
    from torch.testing._internal.distributed.multi_threaded_pg import (
        _install_threaded_pg,
        _uninstall_threaded_pg,
    )

    dist.destroy_process_group()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    store = dist.HashStore()
    results: dict[int, object] = {}

    def worker(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=WORLD, store=store)
        try:
            results[rank] = _train_rank(rank, api)
        except BaseException as e:  # noqa: BLE001 - reported below, with the rank
            results[rank] = e
            from torch.testing._internal.distributed.multi_threaded_pg import ProcessLocalGroup

            ProcessLocalGroup.exception_handle(e)  # wakes the other thread out of its collective
        finally:
            dist.destroy_process_group()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a rank thread did not finish within 60 s"
    _uninstall_threaded_pg()
    for rank in range(WORLD):
        if isinstance(results[rank], BaseException):
            raise AssertionError(f"rank {rank} raised: {results[rank]!r}") from results[rank]
    return [results[r] for r in range(WORLD)]


@pytest.mark.parametrize("api", ["fully_shard", "class"])
def test_trains_on_torchs_threaded_group(api):
    ranks = run_distributed(_threaded_run, 1, api)[0]
    ref_losses, ref_state = _reference()
    for rank, (losses, state) in enumerate(ranks):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=0)
        assert state.keys() == ref_state.keys(), f"rank {rank}"
        for name, ref in ref_state.items():
            torch.testing.assert_close(state[name], ref, rtol=1e-6, atol=1e-7, msg=f"rank {rank}: {name}")
