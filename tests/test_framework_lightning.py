"""Lightning Fabric's own ``FSDPStrategy`` on flatshard, through the opt-in (issue 19).

Each rank runs Fabric (``setup_module``, ``setup_optimizers``, ``backward``) with
``FSDPStrategy(auto_wrap_policy={Block})`` on the tests' GPT for 3 steps, saves a checkpoint
with ``fabric.save`` (``state_dict_type`` "sharded" and "full"), builds a fresh model with
other weights, ``fabric.load`` s it and trains 2 more steps. The oracle is a single-process
run on the same global batches (rtol 1e-5, the tests' parity tolerance): torch's FSDP1 cannot
run under Lightning here (Lightning passes no ``device_id`` on a CPU, and torch FSDP1 then
refuses a CPU-only machine).

Forcing the FSDP path on CPU: Lightning refuses ``FSDPStrategy`` unless the accelerator is a
GPU, by an exact type check; the test passes a subclass of it with nothing changed (a custom
strategy, as Lightning documents them).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from flatshard.testing import run_distributed
from _frameworks import set_launcher_environment
from models import ATOL, RTOL, Block, gpt_loss, make_batch, make_gpt, train_gpt

pytest.importorskip("lightning")

STEPS, SAVE_AT = 5, 3


def _fabric(rank, world_size, state_dict_type):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import FSDPStrategy

    class CPUFSDPStrategy(FSDPStrategy):  # see the module docstring
        pass

    set_launcher_environment(rank, world_size)
    fabric = Fabric(accelerator="cpu", devices=world_size,
                    strategy=CPUFSDPStrategy(auto_wrap_policy={Block}, state_dict_type=state_dict_type))
    fabric.launch()
    return fabric


def _run(rank, world_size, tmp):
    import flatshard

    flatshard.install_as_torch_fsdp()
    got = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for state_dict_type in ("sharded", "full"):
                path = os.path.join(tmp, state_dict_type)
                fabric = _fabric(rank, world_size, state_dict_type)
                model = fabric.setup_module(make_gpt())
                opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
                wrapped = model._forward_module
                assert getattr(wrapped, "_is_flatshard_unit", False) and type(wrapped).__name__ == \
                    "FullyShardedDataParallel"
                losses = train_gpt(model, opt, range(SAVE_AT), rank, world_size, fabric.backward)
                fabric.save(path, {"model": model, "optimizer": opt, "step": SAVE_AT})

                model = fabric.setup_module(make_gpt(seed=7))  # other weights: the checkpoint must replace them
                opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
                state = {"model": model, "optimizer": opt, "step": 0}
                fabric.load(path, state)
                assert state["step"] == SAVE_AT
                got[state_dict_type] = losses + train_gpt(model, opt, range(SAVE_AT, STEPS), rank, world_size,
                                                          fabric.backward)
    finally:
        flatshard.uninstall_as_torch_fsdp()
    return got


def _single_process():
    model = make_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        loss = gpt_loss(model, *make_batch(seed=1000 + step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_lightning_fabric_fsdp_strategy_trains_saves_and_resumes(tmp_path):
    want = torch.tensor(_single_process())
    got = run_distributed(_run, 2, str(tmp_path), timeout=180)[0]
    for state_dict_type, losses in got.items():
        torch.testing.assert_close(torch.tensor(losses), want, rtol=RTOL, atol=ATOL,
                                   msg=f"{state_dict_type}: {losses} vs single process {want.tolist()}")
