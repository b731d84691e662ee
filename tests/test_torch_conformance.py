"""What torch FSDP1 does where tests and scripts look, done the same by flatshard (issue 18).

Each case runs the same code with torch's FSDP1 and flatshard's class at W = 2 (gloo, CPU)
and compares what a script sees; where torch cannot run on CPU, torch's documented
behaviour is the oracle, stated in the case.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import ShardedStateDictConfig, StateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from _cases import CaseRun
from models import SHAPES, build_shape, fsdp_class

IMPLS = ("torch", "flatshard")


def _wrap(impl: str, shape: str, **kwargs):
    FSDP = fsdp_class(impl)
    model = FSDP(build_shape(shape), auto_wrap_policy=ModuleWrapPolicy(set(SHAPES[shape][1])),
                 device_id=torch.device("cpu"), **kwargs)
    return FSDP, model


def _describe(value) -> tuple:
    """What a script can see of a state-dict value: its type, and this rank's chunk (offsets, sizes)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if isinstance(value, ShardedTensor):
        return ("ShardedTensor", tuple(value.size()),
                [(tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes), s.metadata.placement.rank())
                 for s in value.local_shards()],
                [(tuple(m.shard_offsets), tuple(m.shard_sizes)) for m in value.metadata().shards_metadata])
    if isinstance(value, DTensor):
        shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        return ("DTensor", tuple(value.shape), tuple(shape), tuple(offset))
    if isinstance(value, torch.Tensor):
        return ("Tensor", tuple(value.shape))
    return (type(value).__name__,)


def _sharded_values(rank, world_size, case):
    """SHARDED_STATE_DICT values (model and optimizer): ShardedTensors without a device_mesh, DTensors
    with one. (flatshard.checkpoint's get_state_dict gives DTensors where torch's gives ShardedTensors: a
    difference on purpose, see _state_dict_api._state_dict_type.)"""
    impl, how = case
    warnings.filterwarnings("ignore")
    shape = "plain_parent" if world_size == 2 else "padded"  # (W=4: chunks of 1, 1, 1 and none)
    if how == "device_mesh":
        from torch.distributed.device_mesh import init_device_mesh

        FSDP, model = _wrap(impl, shape, device_mesh=init_device_mesh("cpu", (world_size,)))
    else:
        FSDP, model = _wrap(impl, shape)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    if how == "get_state_dict":
        if impl == "torch":
            from torch.distributed.checkpoint.state_dict import get_state_dict
        else:
            from flatshard.checkpoint import get_state_dict
        model_sd, optim_sd = get_state_dict(model, opt)
    else:
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig()):
            model_sd, optim_sd = model.state_dict(), FSDP.optim_state_dict(model, opt)
    return ({k: _describe(v) for k, v in model_sd.items()},
            {f"{n}.{k}": _describe(v) for n, s in optim_sd["state"].items() for k, v in s.items()})


def _cases(world_size: int):
    return world_size, [(f"{how}-{impl}", (impl, how)) for how in ("plain", "device_mesh") for impl in IMPLS]


SHARDED_VALUES = CaseRun(_sharded_values, _cases, timeout=120.0)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("how", ["plain", "device_mesh"])
def test_sharded_state_dict_values_as_torch(how, world_size):
    """ShardedTensor without a device_mesh (`.local_shards()` works), DTensor with one; the same chunks on
    every rank, for the model and the optimizer state."""
    for rank, (ours, theirs) in enumerate(zip(SHARDED_VALUES.results(world_size, f"{how}-flatshard"),
                                              SHARDED_VALUES.results(world_size, f"{how}-torch"))):
        assert ours[0] == theirs[0], f"rank {rank}: model state dict:\n ours   {ours[0]}\n theirs {theirs[0]}"
        assert ours[1] == theirs[1], f"rank {rank}: optimizer state dict:\n ours   {ours[1]}\n theirs {theirs[1]}"
        kind = "DTensor" if how == "device_mesh" else "ShardedTensor"
        assert ours[0]["lin.weight" if world_size == 4 else "body.proj.weight"][0] == kind


def _attributes(rank, world_size, case):
    """torch's public attributes of a unit with parameters and of the root without any (leaf units)."""
    impl, = case
    warnings.filterwarnings("ignore")
    FSDP, model = _wrap(impl, "leaf_units", forward_prefetch=True)
    leaf = model.module.layers[0]
    seen = {}

    def describe(unit):
        return {
            "sharding_strategy": unit.sharding_strategy.name,
            "process_group is the default": unit.process_group is dist.distributed_c10d._get_default_group(),
            "mixed_precision": unit.mixed_precision,
            "cpu_offload": unit.cpu_offload,
            "rank": unit.rank, "world_size": unit.world_size, "compute_device": str(unit.compute_device),
            "limit_all_gathers": unit.limit_all_gathers, "forward_prefetch": unit.forward_prefetch,
            "backward_prefetch": unit.backward_prefetch,
            "params": [tuple(p.shape) for p in unit.params],
            "params[0] is _flat_param": bool(unit.params) and unit.params[0] is unit._flat_param,
            "_flat_param is None": unit._flat_param is None,
            "training_state": unit.training_state.name,
        }

    seen["root"], seen["leaf"] = describe(model), describe(leaf)
    def in_forward(*_):
        seen.setdefault("in forward", leaf.training_state.name)

    leaf.module.register_forward_pre_hook(in_forward)
    loss = model(torch.randn(2, 4)).sum()
    seen["between forward and backward"] = (model.training_state.name, leaf.training_state.name)
    loss.backward()
    seen["after backward"] = (model.training_state.name, leaf.training_state.name)
    with FSDP.summon_full_params(model):
        seen["in summon_full_params"] = (model.training_state.name, leaf.training_state.name)
    return seen


ATTRIBUTES = CaseRun(_attributes, lambda w: (w, [(impl, (impl,)) for impl in IMPLS]), timeout=60.0)


def test_public_attributes_as_torch():
    for rank, (ours, theirs) in enumerate(zip(ATTRIBUTES.results(2, "flatshard"), ATTRIBUTES.results(2, "torch"))):
        assert ours == theirs, f"rank {rank}:\n ours   {ours}\n theirs {theirs}"


# ------------------------------------------------------------ torch's phrases


def _phrases(rank, world_size, case):
    """The errors and warnings tests match, raised where torch raises them, with torch's phrase."""
    impl, = case
    warnings.filterwarnings("ignore")
    FSDP = fsdp_class(impl)
    from torch import nn
    from torch.distributed.fsdp import ShardingStrategy

    seen = {}

    def outcome(key, fn, *, warns=False):
        try:
            if warns:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    fn()
                seen[key] = ("warns", [str(w.message).split(":")[0][:120] for w in caught
                                       if issubclass(w.category, UserWarning) and "FSDP" in str(w.message)
                                       or "top-level" in str(w.message)][:1])
            else:
                fn()
                seen[key] = ("ok",)
        except Exception as e:  # noqa: BLE001 - compared with torch's
            kind = "AssertionError" if isinstance(e, AssertionError) else type(e).__name__  # (ours: also a RuntimeError)
            seen[key] = (kind, str(e)[:len(PHRASES.get(key, ""))] if key in PHRASES else "")

    linear = lambda: nn.Linear(4, 4)  # noqa: E731
    outcome("ignored_modules of a parameter", lambda: FSDP(linear(), ignored_modules=[nn.Parameter(torch.ones(1))]))
    outcome("both ignore arguments", lambda: FSDP(linear(), ignored_modules=[], ignored_states=[]))
    outcome("mixed ignored_states", lambda: FSDP(nn.Sequential(linear(), linear()),
                                                 ignored_states=[nn.Parameter(torch.ones(1)), linear()]))
    with torch.device("meta"):
        meta = nn.Linear(4, 4)
    outcome("param_init_fn not callable", lambda: FSDP(meta, param_init_fn=42, device_id=torch.device("cpu")))
    top = nn.Sequential(linear())
    outcome("ignoring the top-level module", lambda: FSDP(top, ignored_modules=[top], device_id=torch.device("cpu")),
            warns=True)

    model = FSDP(nn.Sequential(FSDP(linear(), device_id=torch.device("cpu")), linear()),
                 device_id=torch.device("cpu"))
    model(torch.randn(2, 4)).sum().backward()
    outcome("clip_grad_norm_ on a nested unit", lambda: model.module[0].clip_grad_norm_(1.0))
    outcome("no_sync on a nested unit", lambda: model.module[0].no_sync().__enter__())
    outcome("rank0_only with writeback", lambda: FSDP.summon_full_params(model, rank0_only=True,
                                                                         writeback=True).__enter__())
    model.zero_grad(set_to_none=True)
    outcome("clip_grad_norm_ without gradients", lambda: model.clip_grad_norm_(1.0), warns=True)

    class SummonsInForward(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = linear()

        def forward(self, x):
            with FSDP.summon_full_params(self_unit[0]):
                pass
            return self.lin(x)

    self_unit = [FSDP(SummonsInForward(), device_id=torch.device("cpu"))]
    outcome("summon during forward", lambda: self_unit[0](torch.randn(2, 4)))

    no_shard = FSDP(linear(), device_id=torch.device("cpu"), sharding_strategy=ShardingStrategy.NO_SHARD)
    outcome("offload_to_cpu with NO_SHARD", lambda: FSDP.summon_full_params(no_shard, offload_to_cpu=True).__enter__())
    flat = FSDP(linear(), device_id=torch.device("cpu"))
    outcome("with_grads without use_orig_params",
            lambda: FSDP.summon_full_params(flat, with_grads=True).__enter__())
    return seen


PHRASES = {
    "ignored_modules of a parameter": "ignored_modules expects nn.Module list elements but got types "
                                      "[<class 'torch.nn.parameter.Parameter'>]",
    "both ignore arguments": "Cannot pass both ignored_modules and ignored_states at the same time. "
                             "Please just pass ignored_states.",
    "mixed ignored_states": "ignored_states expects all nn.Parameter or all nn.Module list elements but got types "
                            "[<class 'torch.nn.modules.linear.Linear'>, <class 'torch.nn.parameter.Parameter'>]",
    "param_init_fn not callable": "Expected 42 to be callable but got <class 'int'>",
    "clip_grad_norm_ on a nested unit": "`clip_grad_norm_()` should only be called on the root FSDP instance",
    "no_sync on a nested unit": "`no_sync()` on inner FSDP instances is not supported. Please call `no_sync()` on "
                                "root FSDP module",
    "rank0_only with writeback": "writeback=True and rank0_only=True is not supported yet",
    "summon during forward": "Cannot manually unshard parameters during forward/backward",
    "offload_to_cpu with NO_SHARD": "offload_to_cpu=True and NO_SHARD is not supported yet",
    "with_grads without use_orig_params": "with_grads=True, use_orig_params=False, offload_to_cpu=False is not "
                                          "supported yet",
}

PHRASE_RUN = CaseRun(_phrases, lambda w: (w, [(impl, (impl,)) for impl in IMPLS]), timeout=60.0)


def test_errors_and_warnings_carry_torch_phrases():
    """Same exception type and torch's phrase at the start of the message (flatshard may add its advice
    after it); the same warnings (torch's text up to its first colon)."""
    ours, theirs = PHRASE_RUN.results(2, "flatshard")[0], PHRASE_RUN.results(2, "torch")[0]
    assert set(ours) == set(theirs)
    for key in theirs:
        if key in PHRASES and theirs[key][0] != "ok":
            assert theirs[key][1] == PHRASES[key], f"torch's own phrase changed for {key}: {theirs[key]}"
        assert ours[key] == theirs[key], f"{key}:\n ours   {ours[key]}\n theirs {theirs[key]}"


# ------------------------------------------------- nesting, ignored modules, with_grads


def _train_steps(model, steps: int, rank: int) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(round(loss.item(), 6))
    return losses


def _nesting(rank, world_size, case):
    """``FSDP(FSDP(m))`` trains as torch's (the outer unit owns nothing), state-dict keys as torch's; a model
    whose inner unit another root already initialized is wrapped again and runs (torch's
    test_multiple_wrapping), and the first root trains on afterwards."""
    impl, = case
    warnings.filterwarnings("ignore")
    FSDP = fsdp_class(impl)
    from torch import nn

    cpu = torch.device("cpu")
    torch.manual_seed(0)
    double = FSDP(FSDP(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)), device_id=cpu), device_id=cpu)
    out = {"double: outer params": len(double.params), "double: losses": _train_steps(double, 3, rank),
           "double: keys": list(double.state_dict())}
    torch.manual_seed(1)
    inner = nn.Sequential(FSDP(nn.Linear(4, 4), device_id=cpu))
    first = FSDP(inner, device_id=cpu)
    out["first: losses"] = _train_steps(first, 2, rank)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(99))
    before = first(x).detach()
    again = FSDP(inner, device_id=cpu)
    out["rewrapped equals"] = torch.equal(again(x).detach(), before)
    out["first again: losses"] = _train_steps(first, 1, rank)
    return out


NESTING = CaseRun(_nesting, lambda w: (w, [(impl, (impl,)) for impl in IMPLS]), timeout=60.0)


def test_nested_units_and_wrapping_twice_as_torch():
    for rank, (ours, theirs) in enumerate(zip(NESTING.results(2, "flatshard"), NESTING.results(2, "torch"))):
        assert ours["rewrapped equals"] and theirs["rewrapped equals"]
        assert ours.keys() == theirs.keys()
        for key in ours:
            if "losses" in key:
                torch.testing.assert_close(torch.tensor(ours[key]), torch.tensor(theirs[key]), rtol=1e-5, atol=1e-6,
                                           msg=f"rank {rank}: {key}")
            else:
                assert ours[key] == theirs[key], f"rank {rank}: {key}: {ours[key]} vs {theirs[key]}"


def _ignored_per_rank(rank, world_size, case):
    """torch's test_diff_ignored_modules_across_ranks: rank r holds r + 1 ignored modules inside a unit;
    every unit's flat layout is the same on every rank, so this is legitimate (the rank guard must accept it)."""
    impl, = case
    warnings.filterwarnings("ignore")
    FSDP = fsdp_class(impl)
    from torch import nn

    cpu = torch.device("cpu")
    torch.manual_seed(0)
    ignored = [nn.Linear(4, 4) for _ in range(rank + 1)]
    body = nn.Sequential(nn.Linear(4, 4), *ignored, nn.Linear(4, 4))
    model = nn.Sequential(nn.Linear(4, 4), body, nn.Linear(4, 4))
    model[1] = FSDP(body, ignored_modules=ignored, device_id=cpu)
    model[2] = FSDP(model[2], device_id=cpu)
    root = FSDP(model, ignored_modules=ignored, device_id=cpu)
    return _train_steps(root, 3, rank)


IGNORED = CaseRun(_ignored_per_rank, lambda w: (w, [(impl, (impl,)) for impl in IMPLS]), timeout=60.0)


def test_different_ignored_modules_across_ranks_as_torch():
    for rank, (ours, theirs) in enumerate(zip(IGNORED.results(2, "flatshard"), IGNORED.results(2, "torch"))):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-5, atol=1e-6, msg=f"rank {rank}")


def _with_grads(rank, world_size, case):
    """summon_full_params(with_grads=True): the full (reduced) gradient, as torch's, for FULL_SHARD and
    NO_SHARD; under NO_SHARD an edit of .grad stays without writeback (the gradient itself), as torch's."""
    impl, strategy = case
    warnings.filterwarnings("ignore")
    from torch.distributed.fsdp import ShardingStrategy

    FSDP, model = _wrap(impl, "plain_parent", use_orig_params=True, sharding_strategy=ShardingStrategy[strategy])
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
    model(x).square().mean().backward()
    with FSDP.summon_full_params(model, with_grads=True):
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    with FSDP.summon_full_params(model, with_grads=True, writeback=False):
        for p in model.parameters():
            p.grad.mul_(2)
    with FSDP.summon_full_params(model, with_grads=True):
        after = {n: p.grad.clone() for n, p in model.named_parameters()}
    return grads, after


WITH_GRADS = CaseRun(_with_grads, lambda w: (w, [(f"{s}-{impl}", (impl, s)) for s in ("FULL_SHARD", "NO_SHARD")
                                                 for impl in IMPLS]), timeout=60.0)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_summon_with_grads_as_torch(strategy):
    for rank, (ours, theirs) in enumerate(zip(WITH_GRADS.results(2, f"{strategy}-flatshard"),
                                              WITH_GRADS.results(2, f"{strategy}-torch"))):
        for what, mine, want in (("gradients", ours[0], theirs[0]), ("after an edit without writeback", ours[1],
                                                                      theirs[1])):
            assert mine.keys() == want.keys()
            for n in want:
                torch.testing.assert_close(mine[n], want[n], rtol=1e-6, atol=1e-7, msg=f"rank {rank}: {what}: {n}")


def _handle_fields(rank, world_size, case):
    """The handle fields frameworks read and call: flat_param, _fqns, _fully_sharded_module, _training_state
    in forward, reshard(True) after a no-grad forward (verl), and accelerate's upcast of a bf16 model (the
    flat parameter's .data replaced by fp32, then _handle._orig_param_dtype set): trains as torch's."""
    impl, = case
    warnings.filterwarnings("ignore")
    from torch.distributed.fsdp import MixedPrecision
    from torch.distributed.fsdp._common_utils import HandleTrainingState

    FSDP, model = _wrap(impl, "root_param")
    handle = model._handle
    seen = {"flat_param is _flat_param": handle.flat_param is model._flat_param,
            "_fqns": list(handle.flat_param._fqns), "_fsdp_flattened": getattr(handle.flat_param, "_fsdp_flattened", None),
            "_fully_sharded_module is module": handle._fully_sharded_module is model.module,
            "_has_params": model._has_params, "leaf _has_params": model.module.lin._has_params}
    model.module.lin.module.register_forward_pre_hook(
        lambda *_: seen.setdefault("root in forward", model._handle._training_state.name) and None)
    with torch.no_grad():
        model(torch.randn(2, 4))
    model._handle.reshard(True)
    seen["idle after reshard"] = model._handle._training_state == HandleTrainingState.IDLE
    # accelerate's upcast (its prepare_model with mixed_precision="bf16"): bf16 weights, fp32 master shards.
    torch.manual_seed(0)
    bf16 = build_shape("leaf_units").to(torch.bfloat16)
    FSDP = fsdp_class(impl)
    model = FSDP(bf16, auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}), device_id=torch.device("cpu"),
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    for module in FSDP.fsdp_modules(model):
        if module._has_params and module._flat_param.dtype != torch.float32 and module._flat_param.requires_grad:
            module._flat_param.data = module._flat_param.data.to(torch.float32)
            module._handle._orig_param_dtype = torch.float32
    seen["upcast dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    seen["upcast losses"] = _train_steps(model, 3, rank)
    return seen


HANDLE = CaseRun(_handle_fields, lambda w: (w, [(impl, (impl,)) for impl in IMPLS]), timeout=60.0)


def test_handle_fields_as_torch():
    for rank, (ours, theirs) in enumerate(zip(HANDLE.results(2, "flatshard"), HANDLE.results(2, "torch"))):
        assert ours.keys() == theirs.keys()
        for key in theirs:
            if key == "upcast losses":
                torch.testing.assert_close(torch.tensor(ours[key]), torch.tensor(theirs[key]), rtol=1e-2, atol=1e-3,
                                           msg=f"rank {rank}: {key}")
            else:
                assert ours[key] == theirs[key], f"rank {rank}: {key}: ours {ours[key]} theirs {theirs[key]}"


def _low_precision_clip(rank, world_size, case):
    """torch's test_low_precision_grads: fp16 mixed precision with keep_low_precision_grads, then
    clip_grad_norm_: .grad stays fp16 (also with use_orig_params), the norm comes back in fp16, as torch's."""
    impl, strategy, use_orig_params = case
    warnings.filterwarnings("ignore")
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy

    mp = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16, keep_low_precision_grads=True)
    FSDP, model = _wrap(impl, "leaf_units", mixed_precision=mp, use_orig_params=use_orig_params,
                        sharding_strategy=ShardingStrategy[strategy])
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
    model(x).square().mean().backward()
    norm = model.clip_grad_norm_(0.01)
    return {"grad dtypes": sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None}),
            "norm": (str(norm.dtype), round(norm.item(), 3))}


LOW_PRECISION_CLIP = CaseRun(_low_precision_clip, lambda w: (w, [
    (f"{s}-orig{int(u)}-{impl}", (impl, s, u)) for s in ("FULL_SHARD", "NO_SHARD") for u in (False, True)
    for impl in IMPLS]), timeout=60.0)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_keep_low_precision_grads_with_clip_grad_norm_as_torch(strategy, use_orig_params):
    tag = f"{strategy}-orig{int(use_orig_params)}"
    for rank, (ours, theirs) in enumerate(zip(LOW_PRECISION_CLIP.results(2, f"{tag}-flatshard"),
                                              LOW_PRECISION_CLIP.results(2, f"{tag}-torch"))):
        assert ours["grad dtypes"] == theirs["grad dtypes"] == ["torch.float16"], (rank, ours, theirs)
        assert ours["norm"][0] == theirs["norm"][0] == "torch.float16", (rank, ours, theirs)
        torch.testing.assert_close(ours["norm"][1], theirs["norm"][1], rtol=1e-2, atol=1e-3)


def _checkpointing_after_wrapping(rank, world_size, case):
    """apply_activation_checkpointing after wrapping (accelerate, Lightning and fms-fsdp do it): the
    checkpoint wrapper is used (each block's forward runs again in backward), `.module` is the block as
    torch's shows it, the FULL state-dict keys and the losses are torch's."""
    impl, = case
    warnings.filterwarnings("ignore")
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    from models import Block, gpt_loss, local_slice, make_batch, make_gpt

    FSDP = fsdp_class(impl)
    model = FSDP(make_gpt(), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    block = model.module.blocks[1]
    calls = []
    [m for m in block.modules() if isinstance(m, Block)][0].register_forward_pre_hook(lambda *_: calls.append(1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(2):
        loss = gpt_loss(model, *local_slice(make_batch(seed=1000 + step), rank, world_size))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"module": type(block.module).__name__, "block forwards": len(calls), "losses": losses,
            "keys": list(model.state_dict())}


CHECKPOINTING = CaseRun(_checkpointing_after_wrapping, lambda w: (w, [(impl, (impl,)) for impl in IMPLS]),
                        timeout=60.0)


def test_activation_checkpointing_applied_after_wrapping_as_torch():
    for rank, (ours, theirs) in enumerate(zip(CHECKPOINTING.results(2, "flatshard"),
                                              CHECKPOINTING.results(2, "torch"))):
        assert ours["block forwards"] == theirs["block forwards"] == 4, (rank, ours, theirs)  # 2 steps x (fwd + rerun)
        assert ours["module"] == theirs["module"] == "Block"
        assert ours["keys"] == theirs["keys"]
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]), rtol=1e-5, atol=1e-6)
