"""Bad input gets a clear error naming the module or parameter and the fix."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from flatshard import FullyShardedDataParallel as FSDP

from models import TiedLM


@pytest.fixture
def single_rank():
    """A gloo process group of one rank in this process."""
    assert not dist.is_initialized()
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(d, 'store')}", rank=0, world_size=1
        )
        try:
            yield
        finally:
            dist.destroy_process_group()


def test_no_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"torch.distributed is not initialized.*init_process_group"):
        FSDP(nn.Linear(2, 2))


def test_tied_weights_split_across_units_names_both(single_rank):
    # Wrapping every Linear puts the head (tied to the embedding) in its own unit.
    with pytest.raises(ValueError) as info:
        FSDP(TiedLM(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    msg = str(info.value)
    assert "'emb.weight'" in msg and "'head.weight'" in msg
    assert "tied parameters must live in one unit" in msg
    assert "'emb'" in msg and "'head'" in msg


def test_tied_weights_in_sibling_units_wrapped_by_hand(single_rank):
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    b.weight = a.weight
    FSDP(a)
    with pytest.raises(ValueError, match=r"'weight' is the same tensor as 'weight'.*tied parameters"):
        FSDP(b)


def test_tied_weights_in_one_unit_are_fine(single_rank):
    model = FSDP(TiedLM(), auto_wrap_policy=ModuleWrapPolicy({type(None)}))
    # One copy of the tied weight: 10*4 (tied) + 4*4 + 4 (body).
    assert model._flat_param.numel() == 10 * 4 + 4 * 4 + 4
    out = model(torch.tensor([[1, 2, 3]]))
    out.sum().backward()
    assert model._flat_param.grad is not None


def test_mixed_dtype_in_one_unit(single_rank):
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())
    with pytest.raises(ValueError) as info:
        FSDP(model)
    msg = str(info.value)
    assert "one dtype" in msg and "'0.weight'" in msg and "'1.weight'" in msg and "torch.float64" in msg


def test_mixed_requires_grad_in_one_unit(single_rank):
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[1].weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"one requires_grad.*'1.weight'"):
        FSDP(model)


@pytest.mark.gpu  # two devices in one unit: the CPU and a CUDA one
def test_mixed_device_in_one_unit(single_rank):
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).cuda())
    with pytest.raises(ValueError, match=r"one device.*'1.weight'"):
        FSDP(model)


class NoReset(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(3, device="meta"))


def test_meta_module_without_reset_parameters(single_rank):
    model = nn.Sequential(nn.Linear(2, 2), NoReset())
    with pytest.raises(ValueError, match=r"module '1' \(NoReset\) has tensors on the meta device.*reset_parameters"):
        FSDP(model)


def test_meta_module_with_reset_parameters_is_materialized(single_rank):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=torch.device("cpu"))
    with FSDP.summon_full_params(model):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert set(params) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    for p in params.values():
        assert p.device.type == "cpu" and torch.isfinite(p).all() and p.abs().sum() > 0


def test_bad_ignored_states(single_rank):
    with pytest.raises(ValueError, match=r"ignored_states expects all nn.Parameter or all nn.Module list elements but got "
                                         r"types \[<class 'torch.Tensor'>\]"):
        FSDP(nn.Linear(2, 2), ignored_states=[torch.ones(1)])


def test_bad_argument_values(single_rank):
    with pytest.raises(ValueError, match=r"sharding_strategy: expected a ShardingStrategy but got 'full'"):
        FSDP(nn.Linear(2, 2), sharding_strategy="full")
    with pytest.raises(ValueError, match=r"auto_wrap_policy: expected .* but got 3"):
        FSDP(nn.Linear(2, 2), auto_wrap_policy=3)


def test_module_tree_stays_a_tree_after_forward(single_rank):
    # The root is not registered as a child of its units: eval(), apply() and
    # named_children() must not see a cycle after lazy init.
    model = FSDP(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    model(torch.ones(1, 2)).sum().backward()
    model.eval()
    assert not model.training and not model.module[0].module.training
    model.train()
    assert [name for name, _ in model.module[0].named_children()] == ["_fsdp_wrapped_module"]
    assert sum(1 for _ in model.modules()) == 6  # root, Sequential, 2 units, 2 Linears




def test_a_tensor_as_the_module(single_rank):
    with pytest.raises(TypeError, match=r"module: expected an nn.Module but got Tensor; pass the model to wrap"):
        FSDP(torch.ones(3))


def test_optimizer_built_before_wrapping_raises_at_its_first_step(single_rank):
    """With use_orig_params=False wrapping replaces the parameters such an optimizer holds: it would train
    nothing (torch FSDP1 too, silently). Its first step raises, naming a parameter and the fix; with
    use_orig_params=True the parameters stay the model's and it trains (see [Note: An optimizer built before
    wrapping])."""
    for use_orig_params in (False, True):
        module = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        opt = torch.optim.SGD(module.parameters(), lr=0.5)
        model = FSDP(module, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=use_orig_params)
        model(torch.ones(1, 2)).sum().backward()
        if use_orig_params:
            with FSDP.summon_full_params(model):
                before = [p.detach().clone() for p in model.parameters()]
            opt.step()
            with FSDP.summon_full_params(model):
                assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters())), "nothing trained"
            continue
        with pytest.raises(ValueError, match=r"SGD.step\(\): the optimizer holds 4 parameter\(s\) that "
                                             r"FullyShardedDataParallel replaced by flat parameters \(e.g. '0.weight' "
                                             r"of unit '0'\): it was built before wrapping.*Build the optimizer after "
                                             r"wrapping"):
            opt.step()
        fresh = torch.optim.SGD(model.parameters(), lr=0.5)  # built after wrapping: fine
        fresh.step()


def test_optimizer_state_of_another_kind_of_optimizer(single_rank):
    """Adam's state loaded into SGD failed at SGD's first step with ``KeyError: 'momentum'`` (torch FSDP1 too): it
    raises at loading, naming both kinds' hyperparameters and the fix. The same kind loads."""
    module = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model = FSDP(module, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    adam = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    adam.step()
    saved = FSDP.optim_state_dict(model, adam)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=r"saved by another kind of optimizer than this SGD: its param group 0 has "
                                         r"\['amsgrad', 'betas', 'eps'\] where SGD's has \['dampening', 'momentum', "
                                         r"'nesterov'\]. Load it into the kind of optimizer that saved it"):
        FSDP.optim_state_dict_to_load(model, sgd, saved)
    again = torch.optim.Adam(model.parameters(), lr=0.1)
    again.load_state_dict(FSDP.optim_state_dict_to_load(model, again, saved))
    assert again.state_dict()["state"][0]["exp_avg"].shape == adam.state_dict()["state"][0]["exp_avg"].shape
