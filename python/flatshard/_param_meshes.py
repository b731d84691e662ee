"""fully_shard's parameters that ``shard_placement_fn`` puts on a mesh of their own.

[Note: Parameters on a mesh of their own]
torch's ``shard_placement_fn`` may return ``ShardPlacementResult(placement, mesh_info)``, whose ``mesh_info`` names
another mesh than the call's: torchtitan's expert parallelism (``torchtitan/distributed/fsdp.py``, EP > 1) shards a
block's routed experts over the expert-data-parallel mesh and the rest of the block over the dense one, in one
``fully_shard(block)``; torch's FSDP2 makes one parameter group per mesh inside the block's state. flatshard's unit
has one flat parameter over one group pair, so such a call first makes, of each largest submodule whose parameters
(those not ignored, nor another unit's) are all on one other mesh, a unit of its own over that mesh, with their
placements (``fully_shard(submodule, mesh=mesh_info.mesh, shard_placement_fn=<the placements>)``, the call's other
arguments as given), then the block's unit over the rest. Each parameter is the DTensor torch's makes (same mesh,
placements, local rows) and is reduced over the same group, so training is the same
(tests/test_fully_shard_expert_mesh.py, against torch's). What differs: the submodule is an ``FSDPModule`` of its own
(torch's is not), with its own pre-forward, where torch gathers both groups at the block's: its all-gather is issued
there, or by the runtime's implicit prefetch, not beside the block's; a block prefetched explicitly
(``set_modules_to_forward_prefetch``, as torchtitan sets under EP) takes its units along. A parameter of another mesh
that no such submodule holds alone (held by the block itself, or beside parameters of the call's mesh in one
submodule), or that two such submodules share, is refused by name before any unit is made, as a mesh given under
``dp_mesh_dims`` (torch's SPMD path) is. A container with no forward (an ``nn.ModuleList`` of experts) gives each
member a unit. The FSDPModule methods of the block (its setters, ``unshard``, ``reshard``) act on these units too, as
torch's act on all of a state's parameter groups; ``set_all_reduce_hook`` is refused with torch's error for several
groups.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from flatshard._common import OWNER_ATTR


def shard_apart(modules: list[nn.Module], mesh: Any, shard_placement_fn: Callable | None, ignored_params: Any,
                fully_shard: Callable, **kwargs: Any) -> list[nn.Module]:
    """Makes the units of the parameters ``shard_placement_fn`` puts on other meshes than ``mesh`` (see the Note);
    ``kwargs``: the call's other arguments, given to each. Returns their modules."""
    if shard_placement_fn is None:
        return []
    ignored = set(ignored_params or ())
    others: dict[int, tuple[Any, set[int]]] = {}  # id of the other mesh -> (its mesh, its parameters' ids)
    for m in modules:
        for name, p in m.named_parameters():
            if p in ignored or getattr(p, OWNER_ATTR, None) is not None:
                continue
            result = shard_placement_fn(p)
            mesh_info = getattr(result, "mesh_info", None)
            other = getattr(mesh_info, "mesh", mesh)
            if type(result).__name__ != "ShardPlacementResult" or other is mesh:
                continue
            if getattr(mesh_info, "is_spmd_mesh", False):
                raise NotImplementedError(f"fully_shard: shard_placement_fn gives parameter '{name}' a mesh of its "
                                          f"own under dp_mesh_dims (torch's SPMD path); flatshard supports that "
                                          f"without dp_mesh_dims only.")
            others.setdefault(id(other), (other, set()))[1].add(id(p))
    plan = []  # (mesh, its submodules): every refusal made before any unit is
    claimed: dict[int, nn.Module] = {}  # id of a parameter -> the submodule whose unit takes it
    for other, ids in others.values():
        # (a submodule reached twice, shared by two parents, is one unit)
        apart = list({id(s): s for m in modules for s in _largest_holding_only(m, ids, ignored)}.values())
        for sub in apart:
            for name, p in sub.named_parameters(remove_duplicate=False):
                if claimed.setdefault(id(p), sub) is not sub:  # (tied across two such submodules)
                    raise NotImplementedError(
                        f"fully_shard: parameter '{name}' of {type(sub).__name__}, on a mesh of its own ({other}), is "
                        f"also registered on {type(claimed[id(p)]).__name__}; flatshard makes such parameters a unit "
                        f"of their own per submodule: call fully_shard([those submodules], mesh=...) first.")
        for m in modules:
            for name, p in m.named_parameters():
                if id(p) in ids and id(p) not in claimed:
                    raise NotImplementedError(
                        f"fully_shard: shard_placement_fn gives parameter '{name}' of {type(m).__name__} a mesh of "
                        f"its own ({other}); flatshard makes such parameters a unit of their own, of a submodule that "
                        f"holds only parameters on that mesh, and '{name}' is held by the module given or beside "
                        f"parameters on the call's mesh: move it into such a submodule, or call fully_shard on that "
                        f"submodule with mesh= first.")
        plan.append((other, apart))
    made = []
    for other, apart in plan:
        for sub in apart:
            fully_shard(sub, mesh=other, shard_placement_fn=lambda p, fn=shard_placement_fn: _placement(fn(p)),
                        ignored_params=ignored_params, **kwargs)
        made += apart
    return made


def _own(module: nn.Module, ignored: set) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p not in ignored and getattr(p, OWNER_ATTR, None) is None]


def _largest_holding_only(module: nn.Module, ids: set[int], ignored: set) -> list[nn.Module]:
    """The largest submodules of ``module`` (itself excluded) whose parameters are all in ``ids``; a container with no
    forward of its own (an ``nn.ModuleList`` of experts) gives its members instead (fully_shard refuses it)."""
    out = []
    for child in module.children():
        params = _own(child, ignored)
        container = isinstance(child, (nn.ModuleList, nn.ModuleDict)) and type(child).forward is nn.Module.forward
        if params and all(id(p) in ids for p in params) and not container:
            out.append(child)
        elif any(id(p) in ids for p in params):
            out += _largest_holding_only(child, ids, ignored)
    return out


def _placement(result: Any) -> Any:
    return getattr(result, "placement", result)
