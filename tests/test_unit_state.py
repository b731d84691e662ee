"""One typed state per unit: the training state at each hook, and the crossings into C++ per step.

The training state ([Note: Unit state] in python/flatshard/_state.py) is read at every
point of a unit's life: inside its module's forward (FORWARD), after its pre-backward
(PRE_BACKWARD) and post-backward (POST_BACKWARD) hooks, after the backward (IDLE), inside
summon_full_params and apply (SUMMONING), and after them (IDLE), inside a forward rerun in
backward by activation checkpointing (PRE_BACKWARD); a hook out of turn raises from the one
switch, and every hook's allowed states are checked.

Crossings ([Note: One crossing per lifecycle step] in csrc/bindings/bindings.cpp): every
call of a method, property or function of ``flatshard._C`` (each replaced by a counting
wrapper for the step) made while a unit's forward, pre-backward or post-backward runs is
counted for that unit, in the second step of training (the first one builds the root).
Limits: forward <= 2 (wait-and-views, then the reshard after forward; the root's forward
asks how many units are sharded, for the rank guard, instead of resharding),
pre-backward <= 2, post-backward exactly 1.
"""

from __future__ import annotations

import collections
import dataclasses
import contextlib
import functools

import pytest
import torch
from torch.distributed.fsdp import BackwardPrefetch
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from flatshard.testing import run_distributed
from models import Block, gpt_loss, local_slice, make_batch, make_gpt


@contextlib.contextmanager
def _counting_crossings():
    """Yields {(phase, unit name): crossings} for the hooks run inside the context: every method,
    property and function of ``flatshard._C`` is replaced by a counting wrapper meanwhile."""
    from flatshard import _C, _backward, _runtime

    counts: collections.Counter = collections.Counter()
    stack: list[tuple[str, str]] = []

    def count(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if stack:
                counts[stack[-1]] += 1
            return fn(*args, **kwargs)
        return wrapper

    replaced = []
    for owner in (_C.Scheduler, _C.FlatParamHandle, _C.FlatParamLayout, _C):
        for name, attr in list(vars(owner).items()):
            if name.startswith("__") or isinstance(attr, type):
                continue
            if isinstance(attr, property):
                new = property(count(attr.fget), attr.fset)
            elif callable(attr):
                new = count(attr)
            else:
                continue
            replaced.append((owner, name, attr))
            setattr(owner, name, new)

    def counted(phase, fn, name_of):
        def wrapper(*args, **kwargs):
            stack.append((phase, name_of(*args)))
            try:
                return fn(*args, **kwargs)
            finally:
                stack.pop()
        return wrapper

    originals = [(_runtime, "forward", _runtime.forward), (_backward, "pre_backward", _backward.pre_backward),
                 (_backward, "post_backward", _backward.post_backward)]
    _runtime.forward = counted("forward", _runtime.forward, lambda unit, *_: unit._unit_state.name)
    _backward.pre_backward = counted("pre-backward", _backward.pre_backward, lambda s, *_: s.name)
    _backward.post_backward = counted("post-backward", _backward.post_backward, lambda s, *_: s.name)
    try:
        yield counts
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)
        for owner, name, attr in replaced:
            setattr(owner, name, attr)


def _crossings(rank, world_size, backward_prefetch, forward_prefetch):
    from flatshard import FullyShardedDataParallel as FSDP

    model = FSDP(make_gpt(), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"),
                 backward_prefetch=backward_prefetch, forward_prefetch=forward_prefetch)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = local_slice(make_batch(), rank, world_size)
    for step in range(2):
        context = _counting_crossings() if step == 1 else contextlib.nullcontext(None)
        with context as counts:
            gpt_loss(model, *batch).backward()
        opt.step()
        opt.zero_grad()
    units = [u._unit_state.name for u in FSDP.fsdp_modules(model)]
    return {f"{phase} {name or '<root>'}": n for (phase, name), n in counts.items()}, units


@pytest.mark.parametrize("backward_prefetch,forward_prefetch", [
    (BackwardPrefetch.BACKWARD_PRE, False), (BackwardPrefetch.BACKWARD_POST, True)])
def test_crossings_into_cpp_per_unit_per_step(backward_prefetch, forward_prefetch):
    counts, units = run_distributed(_crossings, 2, backward_prefetch, forward_prefetch)[0]
    limits = {"forward": 2, "pre-backward": 2, "post-backward": 1}
    for name in units:
        label = name or "<root>"
        for phase, limit in limits.items():
            key = f"{phase} {label}"
            assert key in counts, f"no {phase} counted for unit {label}: {counts}"
            assert counts[key] <= limit, f"{key}: {counts[key]} crossings into C++ (at most {limit}): {counts}"
        assert counts[f"post-backward {label}"] == 1, counts


def _training_states(rank, world_size):
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import _backward, _runtime
    from flatshard._state import TrainingState

    model = FSDP(make_gpt(), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
    block = model.module.blocks[1]  # a unit
    state = block._unit_state
    seen: list[tuple[str, TrainingState]] = []
    block.module.register_forward_pre_hook(lambda *_: seen.append(("in forward", state.training_state)))

    def after(what, fn):
        def wrapper(s, *args, **kwargs):
            out = fn(s, *args, **kwargs)
            if s is state:
                seen.append((what, s.training_state))
            return out
        return wrapper

    originals = {name: getattr(_backward, name) for name in ("pre_backward", "post_backward")}
    _backward.pre_backward = after("after pre-backward", originals["pre_backward"])
    _backward.post_backward = after("after post-backward", originals["post_backward"])
    try:
        seen.append(("before", state.training_state))
        loss = gpt_loss(model, *local_slice(make_batch(), rank, world_size))
        seen.append(("after forward", state.training_state))
        loss.backward()
        seen.append(("after backward", state.training_state))
    finally:
        for name, fn in originals.items():
            setattr(_backward, name, fn)
    with FSDP.summon_full_params(model):
        seen.append(("in summon_full_params", state.training_state))
    seen.append(("after summon_full_params", state.training_state))
    model.apply(lambda m: seen.append(("in apply", state.training_state)) if m is block.module else None)
    seen.append(("after apply", state.training_state))
    # A hook out of turn is flatshard's bug: the one switch raises, naming the unit, the hook and the state.
    with pytest.raises(RuntimeError, match=r"unit 'blocks.1' reached its post-backward in state IDLE \(expected "
                                           r"POST_BACKWARD or PRE_BACKWARD\)"):
        _backward.post_backward(state, _runtime.Use(state), ())
    assert state.training_state is TrainingState.IDLE
    # Recomputation: activation checkpointing applied around the unit after wrapping reruns its forward in
    # backward, where the unit is in PRE_BACKWARD (its gradients come next).
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    model = FSDP(make_gpt(), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
    block = model.module.blocks[1]
    state = block._unit_state
    apply_activation_checkpointing(model, check_fn=lambda m: m is block)
    block.module.register_forward_pre_hook(lambda *_: seen.append(("in forward, checkpointed", state.training_state)))
    gpt_loss(model, *local_slice(make_batch(), rank, world_size)).backward()
    seen.append(("after the backward that recomputed", state.training_state))
    return [(what, s.name) for what, s in seen]


def test_every_hook_that_moves_the_training_state_switches_it_through_the_table():
    """[Note: Unit state]: the state changes in UnitState.switch only, for hooks of the table, each of which
    refuses a state it does not allow."""
    import inspect
    import re

    from flatshard import _backward, _fsdp_module, _full_params, _runtime
    from flatshard._state import TRANSITIONS, TrainingState, UnitState
    from flatshard._torch_facade import attributes

    sources = "".join(inspect.getsource(m) for m in (_runtime, _backward, _fsdp_module, _full_params, attributes))
    assert not re.search(r"training_state\s*=[^=]", sources), "a training state set outside UnitState.switch"
    assert set(re.findall(r'\.switch\("([^"]+)"\)', sources)) == set(TRANSITIONS)
    state = UnitState("blocks.0", torch.nn.Linear(1, 1), None, torch.device("cpu"))  # (no config needed here)
    for hook, (allowed, to) in TRANSITIONS.items():
        for start in TrainingState:
            state.training_state = start
            if start in allowed:
                state.switch(hook)
                assert state.training_state is to, hook
            else:
                with pytest.raises(RuntimeError, match=rf"unit 'blocks.0' reached its {hook} in state {start.name}"):
                    state.switch(hook)
                assert state.training_state is start, hook


def test_training_state_at_each_hook():
    seen = run_distributed(_training_states, 2)[0]
    assert seen == [
        ("before", "IDLE"), ("in forward", "FORWARD"), ("after forward", "IDLE"),
        ("after pre-backward", "PRE_BACKWARD"), ("after post-backward", "POST_BACKWARD"),
        ("after backward", "IDLE"), ("in summon_full_params", "SUMMONING"), ("after summon_full_params", "IDLE"),
        ("in apply", "SUMMONING"), ("after apply", "IDLE"),
        ("in forward, checkpointed", "FORWARD"), ("in forward, checkpointed", "PRE_BACKWARD"),
        ("after the backward that recomputed", "IDLE"),
    ], seen


def _backward_inside_summon(rank, world_size):
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard._common import UsageError

    model = FSDP(make_gpt(), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
    loss = gpt_loss(model, *local_slice(make_batch(), rank, world_size))
    with FSDP.summon_full_params(model):
        with pytest.raises(UsageError, match=r"a backward through unit '.*' ran inside summon_full_params"):
            loss.backward()

    # A unit whose module calls the unit itself again: named, before anything of the inner call runs.
    class CallsItsUnit(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)
            self.unit = None

        def forward(self, x):
            return self.linear(x) if self.unit is None else self.unit.__call__(x)

    inner = CallsItsUnit()
    unit = FSDP(inner, device_id=torch.device("cpu"))
    inner.__dict__["unit"] = unit  # (not a submodule: only the call)
    with pytest.raises(UsageError, match=r"unit '<root>' was called inside its own forward"):
        unit(torch.ones(2, 4))
    inner.__dict__["unit"] = None
    unit(torch.ones(2, 4)).sum().backward()  # the unit is usable after the refusal
    return True


def test_backward_inside_summon_and_a_unit_inside_its_own_forward_are_usage_errors():
    """A user's misuse reaches the hooks' state checks as an error naming it, not as our assertion."""
    assert run_distributed(_backward_inside_summon, 2) == [True, True]


def _configurations(rank, world_size):
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import CustomPolicy

    from flatshard import FullyShardedDataParallel as FSDP

    found = {}
    model = FSDP(make_gpt(), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
    configs = [u._unit_state.config for u in FSDP.fsdp_modules(model)]
    found["units"] = len(configs)
    found["one object"] = all(c is configs[0] for c in configs)
    with pytest.raises(dataclasses.FrozenInstanceError):
        configs[0].world_size = 3

    gpt = make_gpt()
    first = gpt.blocks[0]
    policy = CustomPolicy(lambda m: {"sharding_strategy": ShardingStrategy.NO_SHARD} if m is first
                          else isinstance(m, Block))
    model = FSDP(gpt, auto_wrap_policy=policy, device_id=torch.device("cpu"))
    root = model._unit_state.config
    overridden = gpt.blocks[0]._unit_state.config
    others = [b._unit_state.config for b in gpt.blocks[1:]]
    found["others share the root's"] = all(c is root for c in others)
    found["override"] = (overridden is not root, overridden.sharding_strategy.name, overridden.shard_factor,
                         overridden.process_group is root.process_group, overridden.device_id == root.device_id)

    # An override may give the unit a policy of its own, for its subtree (as torch's FSDP1 passes it on).
    gpt = make_gpt()
    first = gpt.blocks[0]
    inner = CustomPolicy(lambda m: {"auto_wrap_policy": ModuleWrapPolicy({torch.nn.Linear})} if m is first
                         else isinstance(m, Block))
    model = FSDP(gpt, auto_wrap_policy=inner, device_id=torch.device("cpu"))
    found["inner policy"] = sorted(n for n, m in model.named_modules() if isinstance(m, FSDP) and ".blocks.0." in n)

    bad = CustomPolicy(lambda m: {"sharding_strategy": ShardingStrategy.NO_SHARD, "bogus": 1,
                                  "_unit_name": "x"} if isinstance(m, Block) else False)
    with pytest.raises(TypeError) as raised:
        FSDP(make_gpt(), auto_wrap_policy=bad, device_id=torch.device("cpu"))
    found["unknown override"] = str(raised.value)
    return found


def test_one_configuration_per_wrap_call_and_a_copy_per_override():
    """[Note: Unit configuration]: the units one call makes share its frozen UnitConfig; a CustomPolicy's
    overrides give that unit a copy resolved again (the parent's groups reused), or a policy of its own; an
    override that is no constructor argument is refused by name."""
    found = run_distributed(_configurations, 2)[0]
    assert found["units"] == 4 and found["one object"], found
    assert found["others share the root's"], found
    assert found["override"] == (True, "NO_SHARD", 1, True, True), found
    assert [n.rsplit("._fsdp_wrapped_module.", 1)[1] for n in found["inner policy"]] == [
        "attn.proj", "attn.qkv", "mlp.fc", "mlp.out"], found
    assert "the overrides for Block name ['_unit_name', 'bogus']" in found["unknown override"], found


def test_the_resolver_reads_every_constructor_argument():
    """_fsdp1_config.resolve reads the class's arguments by name: the two lists agree (a new argument is
    resolved, or the test says which is missing)."""
    import inspect

    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard._fsdp1_config import ARGUMENTS

    names = [n for n in inspect.signature(FSDP.__init__).parameters
             if n not in ("self", "module", "auto_wrap_policy") and not n.startswith("_")]
    assert tuple(names) == ARGUMENTS


def _forwards_without_backward(rank, world_size):
    """For each front-end: 20 forwards with grad whose outputs are dropped (an evaluation without no_grad), then a
    backward through two forwards: how many unit forwards the iteration's order holds after them, how many units
    there are, and whether the gradients equal a fresh model's through the same two forwards alone; and how many a
    frozen model's order holds after 20 forwards with grad on."""
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import fully_shard

    def build(api):
        model = make_gpt()
        if api == "class":
            return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
        for block in model.blocks:
            fully_shard(block)
        return fully_shard(model)

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    tokens, targets = local_slice(make_batch(), rank, world_size)
    out = {}
    for api in ("class", "fully_shard"):
        grads = []
        for evaluated in (True, False):
            model = build(api)
            if evaluated:
                for _ in range(20):
                    logits = model(tokens)  # (each assignment drops the forward before the last)
                del logits
                root = model._unit_state.root
                held, units = len(root.pre_forward_order), len(root.units)
            (gpt_loss(model, tokens[:, :4], targets[:, :4]) + gpt_loss(model, tokens[:, 4:], targets[:, 4:])).backward()
            grads.append([local(p.grad).clone() for p in model.parameters()])
        out[api] = (held, units, all(torch.equal(a, b) for a, b in zip(*grads)))
        teacher = build(api).requires_grad_(False)  # a frozen model run with grad on (a distillation's teacher)
        for _ in range(20):
            teacher(tokens)
        root = teacher._unit_state.root
        out[f"{api}, frozen"] = (len(root.pre_forward_order), len(root.units), True)
    return out


def test_forwards_without_backward_do_not_grow_the_iteration():
    for rank, out in enumerate(run_distributed(_forwards_without_backward, 2, timeout=120)):
        for api, (held, units, same) in out.items():
            assert held <= 2 * units, f"rank {rank}, {api}: the iteration holds {held} unit forwards of {units} units"
            assert same, f"rank {rank}, {api}: gradients after dropped forwards differ from a fresh model's"


def _class_prefetch_frees_what_did_not_run(rank, world_size):
    """The class with forward_prefetch=True over `_Skippable` (every Linear a unit), against torch's FSDP1: a training
    forward that skips blocks.0, which the unit before it prefetches (the learned order), then one that runs it again.
    Returns each run's losses, and for flatshard's the blocks still gathered after each forward."""
    from flatshard import FullyShardedDataParallel, _C
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from test_fully_shard_state import _Skippable

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    results = {}
    for name, cls in (("torch", TorchFSDP), ("flatshard", FullyShardedDataParallel)):
        model = cls(_Skippable(), auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}), forward_prefetch=True,
                    device_id=torch.device("cpu"))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses, gathered = [], []
        for skip in [(), (0,), ()]:
            loss = model(x, skip).square().mean()
            if name == "flatshard":
                gathered.append([i for i, b in enumerate(model.module.blocks)
                                 if b._unit_state.handle.state != _C.ShardedState.SHARDED])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        results[name] = (losses, gathered)
    return results["flatshard"][0], results["torch"][0], results["flatshard"][1]


def test_the_class_forward_prefetch_frees_a_unit_that_did_not_run():
    """[Note: Forward prefetch] for the class too (its forward_prefetch=True): before, the block the forward skipped
    stayed gathered until the end of backward."""
    for rank, (ours, theirs, gathered) in enumerate(run_distributed(_class_prefetch_frees_what_did_not_run, 2,
                                                                    timeout=120)):
        assert ours == theirs, f"rank {rank}: losses {ours} != torch FSDP1's {theirs}"
        assert gathered == [[], [], []], f"rank {rank}: blocks gathered after each forward: {gathered}"
