"""``fully_shard(..., dp_mesh_dims=...)``, torch's SPMD path (torchtitan's "full_dtensor" backend: parameters and
inputs DTensors on the mesh), on meshes of the data-parallel dims alone and with a TP dim, against torch's FSDP2
running the same script; and its refusals. See [Note: torch's SPMD path] in python/flatshard/_fsdp2_config.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(self.norm(x)))


def _model() -> nn.Module:
    """Blocks of odd widths (padded shards), a root with parameters of its own."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), _Block(5), _Block(5), nn.Linear(5, 3))


_MESHES: dict = {}


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """One mesh per shape and names in a process, for torch's run and flatshard's: DTensor keeps the first of equal
    meshes (a parameter distributed over a second one is on the first), and fully_shard with dp_mesh_dims wants the
    parameters on the very mesh it is given, torch's and flatshard's alike."""
    from torch.distributed.device_mesh import init_device_mesh

    if (shape, names) not in _MESHES:
        _MESHES[shape, names] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[shape, names]


def _trained(rank: int, world_size: int, impl: str, hsdp: bool) -> dict:
    """The model distributed on the mesh (every parameter replicated), fully_shard with dp_mesh_dims on each block and
    the root, three AdamW steps on inputs sharded over the mesh's data dim: losses, each parameter's placements and
    local tensor, its gradient's local tensor before the last step."""
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module

    if impl == "flatshard":
        from flatshard import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    if hsdp:
        replicas = 2 if world_size == 4 else 1
        mesh = _mesh((replicas, world_size // replicas), ("dp_replicate", "dp_shard"))
        dims = DataParallelMeshDims(shard="dp_shard", replicate="dp_replicate")
        batch = (Shard(0), Shard(0)) if replicas > 1 else (Replicate(), Shard(0))
    else:
        mesh = _mesh((world_size,), ("dp_shard",))
        dims = DataParallelMeshDims(shard="dp_shard")
        batch = (Shard(0),)
    model = _model()
    distribute_module(model, mesh)
    for block in model[1:3]:
        fully_shard(block, mesh=mesh, dp_mesh_dims=dims)
    fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses, grads = [], {}
    for step in range(3):
        x = torch.randn(4 * world_size, 6, generator=torch.Generator().manual_seed(step))
        local = x.chunk(world_size)[rank]
        out = model(DTensor.from_local(local, mesh, batch, run_check=False))
        loss = out.square().mean()
        loss.backward()
        grads = {name: p.grad.to_local().clone() for name, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.full_tensor().item())
    return {"losses": losses, "grads": grads, "unsharded": type(model[1].lin.weight).__name__,
            "params": {name: (str(p.placements), p.to_local().detach().clone())
                       for name, p in model.named_parameters()}}


def _both(rank: int, world_size: int, hsdp: bool) -> dict:
    return {impl: _trained(rank, world_size, impl, hsdp) for impl in ("torch", "flatshard")}


@pytest.mark.parametrize("hsdp,world_size", [(False, 2), (True, 2), (True, 4)],
                         ids=["shard", "replicate_shard_1x2", "replicate_shard_2x2"])
def test_dp_mesh_dims_trains_as_torch_fsdp2(hsdp, world_size):
    """Losses, gradients, placements and every rank's local parameters after three steps: equal to torch's FSDP2 given
    the same SPMD mesh, dp_mesh_dims and DTensor inputs (fp32; rtol 1e-6, as the reduction order may differ)."""
    from flatshard.testing import run_distributed

    for rank, out in enumerate(run_distributed(_both, world_size, hsdp, timeout=120)):
        theirs, ours = out["torch"], out["flatshard"]
        assert ours["unsharded"] == theirs["unsharded"] == "DTensor", rank  # (the registered sharded parameter)
        torch.testing.assert_close(ours["losses"], theirs["losses"], rtol=1e-6, atol=0)
        assert ours["params"].keys() == theirs["params"].keys(), rank
        for name, (placements, local) in theirs["params"].items():
            assert ours["params"][name][0] == placements, (rank, name)
            torch.testing.assert_close(ours["grads"][name], theirs["grads"][name], rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(ours["params"][name][1], local, rtol=1e-6, atol=1e-7)


class _MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


def _trained_with_tp(rank: int, world_size: int, impl: str) -> dict:
    """A (dp_shard, tp) mesh: each block's up projection column-wise and down projection row-wise over tp, the norms
    and the head replicated, everything replicated over dp_shard (torchtitan's full_dtensor with TP); fully_shard with
    dp_mesh_dims on each block and the root, three AdamW steps on inputs sharded over dp_shard."""
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.tensor import (
        DTensor,
        Replicate,
        Shard,
        distribute_module,
        distribute_tensor,
    )

    if impl == "flatshard":
        from flatshard import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    mesh = _mesh((2, world_size // 2), ("dp_shard", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(_MLP(6), _MLP(6), nn.Linear(6, 3))

    def on_mesh(name: str, module: nn.Module, device_mesh) -> None:
        for pname, p in list(module.named_parameters(recurse=False)):
            tp = (Shard(0) if name.endswith("up") else Shard(1) if name.endswith("down") and pname == "weight"
                  else Replicate())
            value = distribute_tensor(p.detach(), device_mesh, [Replicate(), tp])
            module.register_parameter(pname, nn.Parameter(value))

    distribute_module(model, mesh, on_mesh)
    dims = DataParallelMeshDims(shard="dp_shard")
    for block in model[:2]:
        fully_shard(block, mesh=mesh, dp_mesh_dims=dims)
    fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses, grads = [], {}
    for step in range(3):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
        local = x.chunk(2)[rank // (world_size // 2)]
        loss = model(DTensor.from_local(local, mesh, (Shard(0), Replicate()), run_check=False)).square().mean()
        loss.backward()
        grads = {name: (str(p.grad.placements), p.grad.to_local().clone()) for name, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.full_tensor().item())
    return {"losses": losses, "grads": grads,
            "params": {name: (str(p.placements), p.to_local().detach().clone())
                       for name, p in model.named_parameters()}}


def _both_with_tp(rank: int, world_size: int) -> dict:
    return {impl: _trained_with_tp(rank, world_size, impl) for impl in ("torch", "flatshard")}


def test_dp_mesh_dims_with_a_tp_dim_trains_as_torch_fsdp2():
    """On a 2x2 (dp_shard, tp) mesh at W=4 (column- and row-wise projections, whose partial and sharded gradients over
    tp are redistributed as torch's, a strided shard where tp shards dim 0 too): losses, gradients and every rank's
    parameters with their placements equal to torch's FSDP2 (rtol 1e-6)."""
    from flatshard.testing import run_distributed

    for rank, out in enumerate(run_distributed(_both_with_tp, 4, timeout=120)):
        theirs, ours = out["torch"], out["flatshard"]
        torch.testing.assert_close(ours["losses"], theirs["losses"], rtol=1e-6, atol=0)
        assert ours["params"].keys() == theirs["params"].keys(), rank
        for name, (placements, local) in theirs["params"].items():
            assert ours["params"][name][0] == placements, (rank, name, ours["params"][name][0], placements)
            assert ours["grads"][name][0] == theirs["grads"][name][0], (rank, name)
            torch.testing.assert_close(ours["grads"][name][1], theirs["grads"][name][1], rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(ours["params"][name][1], local, rtol=1e-6, atol=1e-7)


def _refusals(rank: int, world_size: int) -> None:
    from flatshard import fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

    flat = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    with pytest.raises(ValueError, match=r"all parameters must be DTensors on the full SPMD mesh .* Got plain tensor "
                                         r"for parameter 'weight'"):  # (torch's type and phrase)
        fully_shard(nn.Linear(4, 4), mesh=flat, dp_mesh_dims=DataParallelMeshDims(shard="dp_shard"))
    flattened = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp_shard", "cp"))
    model = nn.Linear(4, 4)
    distribute_module(model, flattened)
    with pytest.raises(NotImplementedError, match=r"fully_shard\(Linear\): dp_mesh_dims \(shard=\('dp_shard', 'cp'\), "
                                                  r"replicate=None\) over a mesh of dims \('dp_shard', 'cp'\): .*\(not "
                                                  r"several flattened into one"):
        fully_shard(model, mesh=flattened, dp_mesh_dims=DataParallelMeshDims(shard=("dp_shard", "cp")))
    assert type(model.weight).__name__ == "DTensor" and type(model).__name__ == "Linear"  # (left as it was)
    sharded = nn.Linear(4, 4)
    sharded.weight = nn.Parameter(distribute_tensor(sharded.weight.detach(), flat, [Shard(0)]))
    sharded.bias = nn.Parameter(distribute_tensor(sharded.bias.detach(), flat, [Shard(0)]))
    with pytest.raises(ValueError, match=r"Expected Replicate\(\) on DP dim 'dp_shard' \(index 0\) but got "
                                         r"S\(0\) \(parameter 'weight'\)"):  # (torch's type and phrase)
        fully_shard(sharded, mesh=flat, dp_mesh_dims=DataParallelMeshDims(shard="dp_shard"))
    assert type(sharded).__name__ == "Linear"
    # torch's checks, types and phrases: a dim the mesh lacks, a parameter on an equal mesh that is not the one given,
    # an int reshard_after_forward.
    model = nn.Linear(4, 4)
    distribute_module(model, flat)
    with pytest.raises(ValueError, match=r"Mesh dim name 'dp' not found in mesh.mesh_dim_names \('dp_shard',\)"):
        fully_shard(model, mesh=flat, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    equal = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    assert equal == flat and equal is not flat
    with pytest.raises(ValueError, match=r"Expected param's DTensor mesh to be the same mesh passed to fully_shard, "
                                         r"but got different mesh objects \(parameter 'weight'"):
        fully_shard(model, mesh=equal, dp_mesh_dims=DataParallelMeshDims(shard="dp_shard"))
    with pytest.raises(NotImplementedError, match=r"reshard_after_forward as int is not yet supported with SPMD mesh "
                                                  r"\(dp_mesh_dims\)"):
        fully_shard(model, mesh=flat, dp_mesh_dims=DataParallelMeshDims(shard="dp_shard"),
                    reshard_after_forward=world_size)
    assert type(model).__name__ == "Linear"


def test_what_dp_mesh_dims_does_not_take_is_refused_by_name():
    """A plain parameter (torch's ValueError), several dims flattened into the shard dim, a parameter sharded on a
    data-parallel dim already, a dim the mesh lacks, a parameter on another mesh object, an int reshard_after_forward
    (torch's types and phrases): refused naming what and where, the module left as it was."""
    from flatshard.testing import run_distributed

    run_distributed(_refusals, 2, timeout=120)
