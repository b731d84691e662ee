"""``torch.distributed.pipelining`` over ``fully_shard`` stages (torchtitan's pipeline and data parallelism), against
torch's FSDP2 running the same script: the schedules reduce the stage's gradients themselves through torch's
``fully_shard.state`` (see [Note: Pipelining reduces the gradients itself] in _torch_facade/fsdp2_state.py); the
zero-bubble schedules' split backward is refused by name.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

_MESHES: dict = {}
_STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "looped_bfs": 2,
                    "interleaved_zero_bubble": 2}


def _mesh(shape: tuple[int, int]) -> Any:
    """One (pp, dp) mesh per process (DTensor keeps the first of equal meshes: see tests/test_fully_shard_spmd.py)."""
    from torch.distributed.device_mesh import init_device_mesh

    if shape not in _MESHES:
        _MESHES[shape] = init_device_mesh("cpu", shape, mesh_dim_names=("pp", "dp"))
    return _MESHES[shape]


def _layers(n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 5)) for _ in range(n)]


def _trained(rank: int, world_size: int, impl: str, schedule: str) -> dict:
    """Each stage a chunk of two blocks, fully_shard on each block and on the chunk over the mesh's dp dim; two
    schedule steps of four micro-batches and an SGD step each: the stage's gradients (local shards, before each
    optimizer step) and its parameters after."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleLoopedBFS,
    )

    if impl == "flatshard":
        from flatshard import fully_shard
    else:  # (torch's, or flatshard's under the opt-in: what the name in torch's package is then)
        from torch.distributed.fsdp import fully_shard
    pp_size = min(world_size, 2)
    mesh = _mesh((pp_size, world_size // pp_size))
    pp_rank = mesh["pp"].get_local_rank()
    per_rank = _STAGES_PER_RANK[schedule]
    n_stages = pp_size * per_rank
    blocks = _layers(2 * n_stages)
    stages, chunks = [], []
    for i in range(per_rank):
        index = pp_rank + i * pp_size  # (interleaved: stages pp_rank, pp_rank + pp_size on this rank)
        chunk = nn.Sequential(*blocks[2 * index:2 * index + 2])
        for block in chunk:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(chunk, mesh=mesh["dp"])
        chunks.append(chunk)
        stages.append(PipelineStage(chunk, index, n_stages, torch.device("cpu"), group=mesh.get_group("pp")))
    loss_fn = lambda out, y: ((out - y) ** 2).mean()
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
           "looped_bfs": ScheduleLoopedBFS, "interleaved_zero_bubble": ScheduleInterleavedZeroBubble}[schedule]
    pipe = cls(stages[0] if per_rank == 1 else stages, n_microbatches=4, loss_fn=loss_fn)
    params = [p for chunk in chunks for p in chunk.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    dp_rank = mesh["dp"].get_local_rank()
    out: dict = {"grads": []}
    for step in range(2):
        g = torch.Generator().manual_seed(100 * step + dp_rank)  # (each dp replica its own batch)
        x, y = torch.randn(8, 5, generator=g), torch.randn(8, 5, generator=g)
        pipe.step(*([x] if pp_rank == 0 else []), **({"target": y} if pp_rank == pp_size - 1 else {}))
        out["grads"].append([p.grad.to_local().clone() for p in params])
        opt.step()
        opt.zero_grad()
    out["params"] = [p.detach().to_local().clone() for p in params]
    return out


def _all(rank: int, world_size: int) -> dict:
    """Every schedule, torch's FSDP2 and flatshard's, in one process start; one under the opt-in (as torchtitan
    reaches flatshard: FLATSHARD_AS_TORCH_FSDP=1), where the name pipelining imported is flatshard's."""
    import flatshard

    out = {(impl, schedule): _trained(rank, world_size, impl, schedule)
           for schedule in ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs") for impl in ("torch", "flatshard")}
    flatshard.install_as_torch_fsdp()
    try:
        out["opt-in", "1f1b"] = _trained(rank, world_size, "opt-in", "1f1b")
    finally:
        flatshard.uninstall_as_torch_fsdp()
    return out


def test_pipeline_schedules_over_fully_shard_stages_train_as_torch():
    """pp 2 x dp 2: gradients before each step and parameters after, equal to torch's FSDP2's (rtol 1e-6: the
    dp reduction's sum and division in another order). Before the Note's state, every schedule's step raised
    AttributeError: 'NoneType' object has no attribute '_state_ctx'."""
    from flatshard.testing import run_distributed

    for rank, out in enumerate(run_distributed(_all, 4, timeout=240)):
        for impl, schedule in (("flatshard", "gpipe"), ("flatshard", "1f1b"), ("flatshard", "interleaved_1f1b"),
                               ("flatshard", "looped_bfs"), ("opt-in", "1f1b")):
            want, have = out["torch", schedule], out[impl, schedule]
            for step, (w, h) in enumerate(zip(want["grads"], have["grads"])):
                for i, (a, b) in enumerate(zip(w, h)):
                    torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7,
                                               msg=f"rank {rank} {impl} {schedule}: gradient {i} at step {step}")
            for i, (a, b) in enumerate(zip(want["params"], have["params"])):
                torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7,
                                           msg=f"rank {rank} {impl} {schedule}: parameter {i}")


def _split_backward(rank: int, world_size: int) -> dict:
    """The zero-bubble schedule on one rank (its two stages there), refused at its first split backward."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from flatshard import fully_shard

    with pytest.raises(NotImplementedError, match=r"torch\.distributed\.pipelining runs a split backward \('input' "
                                                  r"half, the zero-bubble schedules\) through FSDPSequential: "
                                                  r"flatshard's fully_shard does not support the split backward"):
        _trained(rank, world_size, "flatshard", "interleaved_zero_bubble")
    model = fully_shard(nn.Linear(4, 4))
    assert fully_shard.state(model) is torch_fully_shard.state(model) is not None  # (what pipelining reads)
    return {}


def test_the_zero_bubble_split_backward_is_refused_by_name():
    """Its two halves would differentiate with respect to each parameter as a leaf, which flatshard's unsharded
    parameters are not (torch's code then fails with a KeyError on flatshard's node, or trains without them)."""
    from flatshard.testing import run_distributed

    run_distributed(_split_backward, 1, timeout=120)
