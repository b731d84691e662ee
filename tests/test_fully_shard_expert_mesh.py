"""``shard_placement_fn`` giving some parameters a mesh of their own (``ShardPlacementResult(placement, mesh_info)``),
torchtitan's expert parallelism (``torchtitan/distributed/fsdp.py``, EP > 1): a block's routed experts, DTensors over
the EP mesh, sharded over the expert-data-parallel mesh, the block's other parameters over the dense one; against
torch's FSDP2 on the same script. See [Note: Parameters on a mesh of their own] in python/flatshard/_param_meshes.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

_MESHES: dict = {}


def _meshes(world_size: int) -> tuple[Any, Any, Any]:
    """(the dense data-parallel mesh, the expert-data-parallel mesh, the EP mesh), one set per process (DTensor keeps
    the first of equal meshes)."""
    from torch.distributed.device_mesh import init_device_mesh

    if world_size not in _MESHES:
        sparse = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("efsdp", "ep"))
        dense = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
        _MESHES[world_size] = (dense, sparse["efsdp"], sparse["ep"])
    return _MESHES[world_size]


class _Experts(nn.Module):
    """Four experts' weights, sharded over the EP mesh (each rank holds two); each rank runs its own experts on its
    tokens (a stand-in for the token dispatch, which FSDP never sees)."""

    def __init__(self, ep_mesh: Any) -> None:
        super().__init__()
        from torch.distributed.tensor import Shard, distribute_tensor

        self.w = nn.Parameter(distribute_tensor(torch.randn(4, 6, 6) * 0.3, ep_mesh, [Shard(0)]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.w.to_local() if hasattr(self.w, "to_local") else self.w
        return sum(torch.tanh(x @ w[i]) for i in range(w.shape[0]))


class _Block(nn.Module):
    def __init__(self, ep_mesh: Any) -> None:
        super().__init__()
        self.router = nn.Linear(6, 6)
        self.experts = _Experts(ep_mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.experts(self.router(x))


class _ListedExperts(nn.Module):
    """HF's layout (Mixtral, Qwen2-MoE): the experts an ``nn.ModuleList`` of modules, a container with no forward."""

    def __init__(self, ep_mesh: Any) -> None:
        super().__init__()
        self.router = nn.Linear(6, 6)
        self.experts = nn.ModuleList(nn.Linear(6, 6) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.router(x)
        return x + sum(torch.tanh(e(h)) for e in self.experts)


def _trained(rank: int, world_size: int, impl: str, dim: int, variant: str = "") -> dict:
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
    from torch.distributed.tensor import Shard

    if impl == "flatshard":
        from flatshard import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    dense, edp, ep = _meshes(world_size)
    torch.manual_seed(0)
    block_cls = _ListedExperts if variant == "listed_experts" else _Block
    model = nn.Sequential(nn.Linear(6, 6), block_cls(ep), block_cls(ep), nn.Linear(6, 3))
    edp_info, dense_info = _get_mesh_info(edp), _get_mesh_info(dense)
    for block in (model[1], model[2]):
        experts = set(block.experts.parameters())

        def placement(p: nn.Parameter, experts: set = experts) -> ShardPlacementResult:
            if p in experts:  # (dim 1: torchtitan's when the expert-data-parallel size exceeds the experts)
                return ShardPlacementResult(placement=Shard(dim), mesh_info=edp_info)
            return ShardPlacementResult(placement=Shard(0), mesh_info=dense_info)

        fully_shard(block, mesh=dense, shard_placement_fn=placement)
    fully_shard(model, mesh=dense)
    if variant == "divided_by_3_on_blocks":  # (set on the blocks and the root only: torch's reaches every group)
        for m in (model, model[1], model[2]):
            m.set_force_sum_reduction_for_comms(True)
            m.set_gradient_divide_factor(3.0)
    # torchtitan's explicit prefetch under EP (each block gathers the next in forward, the previous in backward)
    model[1].set_modules_to_forward_prefetch([model[2]])
    model[2].set_modules_to_backward_prefetch([model[1]])
    if impl == "flatshard" and not variant:  # (the experts' unit goes along with its block)
        assert model[1]._unit_state.forward_prefetch_to == [model[2]._unit_state, model[2].experts._unit_state]
    with pytest.raises(ValueError, match="set_all_reduce_hook is not supported with multiple param groups"):
        model[1].set_all_reduce_hook(lambda _: None)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    out: dict = {"losses": []}
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(x).pow(2).mean()
        loss.backward()
        out["losses"].append(loss.item())
        out["grads"] = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    out["params"] = {n: (p.to_local().detach().clone(), str(p.placements), p.device_mesh.mesh_dim_names)
                     for n, p in model.named_parameters()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    # (a data path: the full model and optimizer state dicts, gathered over both meshes)
    full = StateDictOptions(full_state_dict=True)
    out["state_dict"] = {k: v.clone() for k, v in get_model_state_dict(model, options=full).items()}
    out["optim_state"] = {f"{k}.{name}": v.clone() for k, state in get_optimizer_state_dict(model, opt, options=full)[
        "state"].items() for name, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    return out


VARIANTS = ((0, ""), (1, ""), (0, "divided_by_3_on_blocks"), (0, "listed_experts"))


def _all(rank: int, world_size: int) -> dict:
    out = {(impl, dim, variant): _trained(rank, world_size, impl, dim, variant)
           for dim, variant in VARIANTS for impl in ("torch", "flatshard")}
    _refusal(world_size)
    return out


def _refusal(world_size: int) -> None:
    """A parameter of another mesh held by the module given itself: no submodule to make its unit of."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
    from torch.distributed.tensor import Shard

    from flatshard import fully_shard

    dense, edp, _ = _meshes(world_size)
    block = nn.Linear(6, 6)
    with pytest.raises(NotImplementedError, match=r"shard_placement_fn gives parameter 'bias' of Linear a mesh of "
                                                  r"its own .* held by the module given or beside parameters on the "
                                                  r"call's mesh"):
        fully_shard(block, mesh=dense, shard_placement_fn=lambda p: ShardPlacementResult(
            Shard(0), _get_mesh_info(edp if p is block.bias else dense)))


def test_experts_on_a_mesh_of_their_own_train_as_torch():
    """W = 4: dense dp 4, experts efsdp 2 x ep 2; the experts sharded on dim 0 and on dim 1; a divide factor set on the
    blocks (which torch's applies to the experts too); HF's ModuleList of experts. Losses, every gradient's and
    parameter's local tensor, each parameter's placements and mesh, the full model and optimizer state dicts equal to
    torch's (rtol 1e-6: gloo's sums)."""
    from flatshard.testing import run_distributed

    for rank, out in enumerate(run_distributed(_all, 4, timeout=240)):
        for dim, variant in VARIANTS:
            want, have = out["torch", dim, variant], out["flatshard", dim, variant]
            assert have["losses"] == pytest.approx(want["losses"], rel=1e-6), (rank, dim, variant)
            assert list(have["grads"]) == list(want["grads"]), (rank, list(have["grads"]))
            for name in want["grads"]:
                torch.testing.assert_close(have["grads"][name], want["grads"][name], rtol=1e-6, atol=1e-7,
                                           msg=f"rank {rank} dim {dim} {variant}: gradient of {name}")
                local, placements, names = have["params"][name]
                assert (placements, names) == want["params"][name][1:], (rank, dim, variant, name, placements, names)
                torch.testing.assert_close(local, want["params"][name][0], rtol=1e-6, atol=1e-7,
                                           msg=f"rank {rank} dim {dim} {variant}: {name}")
            for kind in ("state_dict", "optim_state"):
                assert list(have[kind]) == list(want[kind]), (rank, dim, variant, kind, list(have[kind]))
                for key in want[kind]:
                    torch.testing.assert_close(have[kind][key], want[kind][key], rtol=1e-6, atol=1e-7,
                                               msg=f"rank {rank} dim {dim} {variant}: {kind} {key}")
