"""Training patterns beyond the plain loop: activation checkpointing, a backward that
raises, forwards without backward, meta-device init with tied weights, moves after wrapping.

Each training case compares against a single-process run on the same global batch
(rtol 1e-5 / atol 1e-6 after several Adam steps) and, where torch's FSDP1 supports the
pattern, runs the same function with torch's class.
"""

import functools

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from flatshard.testing import run_distributed
from models import ATOL, RTOL, Block, TiedLM, fsdp_class, gpt_loss, local_slice, make_batch, make_gpt

STEPS = 4


def _reference(steps_to_skip=()):
    torch.manual_seed(0)
    model = make_gpt()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    batch = make_batch()
    for step in range(STEPS):
        if step in steps_to_skip:
            continue
        gpt_loss(model, *batch).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def _compare(FSDP, model, reference, where):
    with FSDP.summon_full_params(model):
        # named_parameters() keeps checkpoint_wrapper's prefix (torch's FSDP too).
        full = {n.replace("_checkpoint_wrapped_module.", ""): p.detach().clone() for n, p in model.named_parameters()}
    assert set(full) == set(reference), f"{where}: names {sorted(full)} != {sorted(reference)}"
    for name, ref in reference.items():
        torch.testing.assert_close(full[name], ref, rtol=RTOL, atol=ATOL, msg=f"{where}: {name}")


def _activation_checkpointing(rank, world_size, impl, placement, reentrant):
    FSDP = fsdp_class(impl)
    model = make_gpt()
    impl_kind = CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=impl_kind),
        check_fn=lambda m: isinstance(m, Block),
    )
    wrapper_cls = type(model.blocks[0])
    # "inside": each unit is FSDP(CheckpointWrapper(Block)); "around": CheckpointWrapper(FSDP(Block));
    # "root": the root unit's whole forward under torch.utils.checkpoint.checkpoint (and the blocks inside).
    policy = ModuleWrapPolicy({wrapper_cls} if placement != "around" else {Block})
    model = FSDP(model, auto_wrap_policy=policy, device_id=torch.device("cpu"))
    if placement == "root":
        loss_of = functools.partial(_checkpointed_root_loss, reentrant=reentrant)
    else:
        loss_of = gpt_loss
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    batch = local_slice(make_batch(), rank, world_size)
    peak = 0
    for _ in range(STEPS):
        if impl == "flatshard":
            from flatshard import _C

            _C.reset_peak_unsharded_bytes()
        loss_of(model, *batch).backward()
        if impl == "flatshard":
            peak = max(peak, _C.peak_unsharded_bytes())
            assert _C.unsharded_bytes() == 0
        for unit in FSDP.fsdp_modules(model):
            assert unit._flat_param is None or unit._flat_param.grad is not None, "a unit got no gradient"
        opt.step()
        opt.zero_grad()
    _compare(FSDP, model, _reference(), f"{impl} AC {placement} reentrant={reentrant}")
    if impl == "flatshard" and world_size > 1:
        # Not every unit unsharded at once: reductions and reshards ran during backward.
        largest = max(u._unit_state.handle.unsharded_nbytes for u in FSDP.fsdp_modules(model) if u._unit_state.handle is not None)
        assert peak <= 3 * largest, f"peak unsharded {peak} B > 3 x largest unit {largest} B"


def _checkpointed_root_loss(model, tokens, targets, reentrant):
    # Reentrant checkpointing needs an input that requires grad (the tokens do not): the usual dummy.
    dummy = torch.ones((), requires_grad=True)
    logits = torch.utils.checkpoint.checkpoint(lambda t, _: model(t), tokens, dummy, use_reentrant=reentrant)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("impl", ["flatshard", "torch"])
@pytest.mark.parametrize("placement", ["inside", "around", "root"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing(impl, placement, reentrant):
    run_distributed(_activation_checkpointing, 2, impl, placement, reentrant)


class _FailOnce(Exception):
    pass


def _backward_raises_then_training_goes_on(rank, world_size):
    from flatshard import FullyShardedDataParallel as FSDP

    model = FSDP(make_gpt(), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    batch = local_slice(make_batch(), rank, world_size)
    block1 = model.module.blocks[1]
    def boom(grad):
        raise _FailOnce()

    for step in range(STEPS):
        hook = None
        if step == 1:
            hook = block1.module.register_forward_hook(lambda m, i, out: out.register_hook(boom) and None)
        loss = gpt_loss(model, *batch)
        if hook is not None:
            hook.remove()
        if step == 1:
            # Fail in the middle of backward, after some units reduced: every rank alike.
            try:
                loss.backward()
            except _FailOnce:
                pass
            else:
                raise AssertionError("the hook did not raise")
            # No zero_grad: the next forward drops the failed batch's gradients on every rank.
            continue
        if step == 2:
            for unit in FSDP.fsdp_modules(model):
                assert unit._flat_param.grad is None, f"unit '{unit._unit_state.name}' kept a partial gradient"
        loss.backward()
        for unit in FSDP.fsdp_modules(model):
            assert unit._flat_param.grad is not None, f"unit '{unit._unit_state.name}' got no gradient"
        opt.step()
        opt.zero_grad()
    _compare(FSDP, model, _reference(steps_to_skip={1}), "after a backward that raised")


def test_backward_that_raises_is_recovered():
    run_distributed(_backward_raises_then_training_goes_on, 2)


def _forward_without_backward(rank, world_size, impl):
    FSDP = fsdp_class(impl)
    model = FSDP(make_gpt(), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    batch = local_slice(make_batch(), rank, world_size)
    for step in range(STEPS):
        gpt_loss(model, *batch).item()  # grad enabled, no backward: e.g. logging a validation loss
        gpt_loss(model, *batch).backward()
        if impl == "flatshard":
            for unit in FSDP.fsdp_modules(model):
                assert not unit._has_pending_uses(), f"unit '{unit._unit_state.name}' kept a dead use"
        opt.step()
        opt.zero_grad()
    _compare(FSDP, model, _reference(), f"{impl}: forward without backward between steps")


@pytest.mark.parametrize("impl", ["flatshard", "torch"])
def test_forward_without_backward(impl):
    run_distributed(_forward_without_backward, 2, impl)


def _meta_init_keeps_ties(rank, world_size):
    from flatshard import FullyShardedDataParallel as FSDP

    with torch.device("meta"):
        model = TiedLM()
    model = FSDP(model, device_id=torch.device("cpu"))
    with FSDP.summon_full_params(model):
        names = [n for n, _ in model.named_parameters()]
        assert model.module.head.weight is model.module.emb.weight, "the tie was lost"
    assert names == ["emb.weight", "body.weight", "body.bias"], names
    assert model._unit_state.handle.layout.num_params == 3
    # Tied across units on the meta device: the error, not a silent untie.
    with torch.device("meta"):
        split = TiedLM()
    try:
        FSDP(split, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=torch.device("cpu"))
    except ValueError as e:
        assert "tied parameters must live in one unit" in str(e) and "'emb.weight'" in str(e), str(e)
    else:
        raise AssertionError("a tie split across units on the meta device was not reported")


def test_meta_init_keeps_tied_parameters():
    run_distributed(_meta_init_keeps_ties, 2)


def _cast_after_wrapping(rank, world_size, impl, use_orig_params, when) -> list[float]:
    """model.double() after wrapping: before the first forward ("before"), or between two steps
    ("between"; torch's FSDP1 then fails its next all-gather). impl "local": the unwrapped model."""
    if impl == "local":
        model, local = make_gpt(), make_batch()
    else:
        model = fsdp_class(impl)(make_gpt(), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"),
                                 use_orig_params=use_orig_params)
        local = local_slice(make_batch(), rank, world_size)
    if when == "between":  # one fp32 step first
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gpt_loss(model, *local).backward()
        opt.step()
        opt.zero_grad()
    model.float()  # a no-op
    model.double()
    assert all(p.dtype == torch.float64 for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        loss = gpt_loss(model, *local)
        assert loss.dtype == torch.float64
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    losses = torch.stack(losses)
    if impl != "local":
        torch.distributed.all_reduce(losses)
        losses /= world_size
    if impl == "flatshard":
        try:
            model.to("meta")
        except ValueError as e:
            assert "expected no move after wrapping" in str(e), str(e)
        else:
            raise AssertionError("a move after wrapping was not refused")
    return losses.tolist()


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_cast_after_wrapping_as_torch(use_orig_params):
    ours = run_distributed(_cast_after_wrapping, 2, "flatshard", use_orig_params, "before")
    theirs = run_distributed(_cast_after_wrapping, 2, "torch", use_orig_params, "before")
    assert ours == theirs, f"{ours} vs torch {theirs}"
    # Between steps too (torch's FSDP1 fails there), against the unwrapped model.
    ours = run_distributed(_cast_after_wrapping, 2, "flatshard", use_orig_params, "between")[0]
    want = _cast_after_wrapping(0, 1, "local", use_orig_params, "between")
    torch.testing.assert_close(torch.tensor(ours, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               rtol=1e-6, atol=0)  # (the first step ran in fp32)


def _frozen_unit(rank, world_size):
    from torch.profiler import ProfilerActivity, profile

    from flatshard import FullyShardedDataParallel as FSDP

    def freeze(model):
        for p in model.blocks[1].parameters():
            p.requires_grad_(False)
        return model

    reference = freeze(make_gpt())
    ref_opt = torch.optim.Adam([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    model = FSDP(freeze(make_gpt()), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batch = make_batch()
    local = local_slice(batch, rank, world_size)
    for step in range(STEPS):
        gpt_loss(reference, *batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = gpt_loss(model, *local)
        with profile(activities=[ProfilerActivity.CPU]) as prof:  # the backward only
            loss.backward()
        opt.step()
        opt.zero_grad()
    assert model.module.blocks[1]._flat_param.grad is None
    # The frozen unit is resharded when its backward ends, before the next unit's reduction.
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    names = [e.name for e in events]
    assert "flatshard::reshard blocks.1" in names and "flatshard::reduce_scatter blocks.0" in names, names
    assert names.index("flatshard::reshard blocks.1") < names.index("flatshard::reduce_scatter blocks.0")
    with FSDP.summon_full_params(model):
        full = {n: p.detach().clone() for n, p in model.named_parameters()}
    for name, p in reference.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), rtol=RTOL, atol=ATOL, msg=name)


def test_frozen_unit_trains_the_rest_and_reshards_in_backward():
    run_distributed(_frozen_unit, 2)


def _ranks_keep_different_graphs(rank, world_size, collect_garbage):
    """Rank 0 keeps an extra forward's output (say, for logging), or frees a graph held in a
    reference cycle at another moment than its peer: which collectives run must not change."""
    import gc

    from flatshard import FullyShardedDataParallel as FSDP

    model = FSDP(make_gpt(), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    batch = local_slice(make_batch(), rank, world_size)
    kept = []
    for _ in range(STEPS):
        extra = gpt_loss(model, *batch)  # grad enabled, never backpropagated
        if collect_garbage:
            cycle = [extra]
            cycle.append(cycle)  # only the cyclic collector frees this graph
            del extra, cycle
            if rank == 0:
                gc.collect()
        elif rank == 0:
            kept.append(extra)
        else:
            del extra
        gpt_loss(model, *batch).backward()
        opt.step()
        opt.zero_grad()
    _compare(FSDP, model, _reference(), f"graphs kept differently (gc={collect_garbage})")


@pytest.mark.parametrize("collect_garbage", [False, True])
def test_ranks_keeping_different_graphs_issue_the_same_collectives(collect_garbage):
    run_distributed(_ranks_keep_different_graphs, 2, collect_garbage, pg_timeout=20.0)


def _apply_after_wrapping(rank, world_size, impl):
    """model.apply(init) after wrapping (as torch's FSDP allows) writes every rank's shards."""
    FSDP = fsdp_class(impl)
    model = FSDP(make_gpt(), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
    visited = []

    def init(m):
        visited.append(type(m).__name__)
        if isinstance(m, nn.Linear):
            nn.init.constant_(m.weight, 1.0 / (m.in_features + m.out_features))
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    model.apply(init)
    assert "Block" in visited and "GPT" in visited, visited
    want = make_gpt()
    want.apply(init)  # the same fn on a plain model
    with FSDP.summon_full_params(model):
        full = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.testing.assert_close(full, dict(want.named_parameters()), rtol=0, atol=0)
    gpt_loss(model, *local_slice(make_batch(), rank, world_size)).backward()  # still trains
    # apply() through units wrapped by hand before their parent is wrapped: the parent is the root.
    gpt = make_gpt()
    for i, block in enumerate(gpt.blocks):
        gpt.blocks[i] = FSDP(block, device_id=torch.device("cpu"))
    gpt.apply(init)
    outer = FSDP(gpt, device_id=torch.device("cpu"))
    gpt_loss(outer, *local_slice(make_batch(), rank, world_size)).backward()
    with FSDP.summon_full_params(outer):
        torch.testing.assert_close(outer.module.blocks[0].module.mlp.fc.weight, want.blocks[0].mlp.fc.weight)
    if impl == "flatshard" and world_size > 1:
        # Outside summon a sharded unit's parameters have no storage: an error naming it, not a crash.
        weight = model.module.blocks[1].module.mlp.fc.weight
        assert weight.shape == (64, 16)
        try:
            weight.fill_(1.0)
        except RuntimeError as e:
            assert "unit 'blocks.1' has no storage between iterations" in str(e), str(e)
            assert "summon_full_params" in str(e), str(e)
        else:
            raise AssertionError("writing to a sharded parameter outside summon_full_params did not raise")


@pytest.mark.parametrize("impl", ["flatshard", "torch"])
def test_apply_after_wrapping(impl):
    run_distributed(_apply_after_wrapping, 2, impl)
