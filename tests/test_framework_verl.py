"""verl's own ``verl.utils.fsdp_utils`` on flatshard, through the opt-in (issue 19), against torch FSDP1.

verl's FSDP1 workers build torch's class and reach into its internals. Each rank runs, on
a tiny HF Llama wrapped with verl's ``get_fsdp_wrap_policy`` (``use_orig_params`` True and
False), the PPO-step pattern: a no-grad forward (a rollout's log-probs) and
``model._handle.reshard(True)``, then an update; the model and optimizer offloaded to the
host and loaded back mid-training (``offload_fsdp_model_to_cpu`` / ``offload_fsdp_optimizer``
/ ``load_fsdp_model_to_gpu`` / ``load_fsdp_optimizer``, which go through torch's
``_lazy_init``, ``_all_handles`` and ``handle.flat_param_to``); ``fsdp_version``;
``get_fsdp_full_state_dict`` (not offloaded: torch FSDP1 segfaults offloading on CPU);
``fsdp1_sharded_save_to_cpu``; the SHARDED export of verl's weight sync (a model with a
device mesh, each DTensor's ``full_tensor()``); and, on a peft LoRA model,
``collect_lora_params`` layered and not. First on torch's FSDP1 (it runs on CPU with
``device_id=cpu``), then under ``flatshard.install_as_torch_fsdp()``: every loss and
tensor must be torch's, within rtol 1e-5 (``clip_grad_norm_`` sums its squares in another
order, which moves the clip coefficient by an ulp; see tests/test_hf_sft.py). torch FSDP1's FULL
state-dict hook segfaults on CPU inside ``collect_lora_params`` and after verl's offload
round trip (torch 2.13): the LoRA tensors are checked against the unwrapped model's own,
and the full state dict is taken before the offload. ``collect_lora_params`` with
``base_sync_done=False`` (the whole base model, moved with ``.to("cpu")`` inside
``summon_full_params``) is checked the same way.

peft is held below 0.21 (scripts/_setup.sh): 0.21 finds LoRA entries by module names with
only a leading ``_fsdp_wrapped_module`` removed, so with nested FSDP1 units (verl's LoRA wrap
policy) ``collect_lora_params`` finds none, on torch's FSDP1 as on flatshard.
verl's device lookup is pointed at the CPU (it assumes CUDA without another accelerator).
verl is installed with ``--no-deps`` plus what ``verl.utils.fsdp_utils`` imports (ray,
tensordict, omegaconf: see scripts/_setup.sh).
"""

from __future__ import annotations


import pytest
import torch

from flatshard.testing import run_distributed
from _frameworks import tiny_llama, torch_then_flatshard

RTOL, ATOL = 1e-5, 1e-7

pytest.importorskip("verl.utils.fsdp_utils", reason="verl (scripts/_setup.sh installs it)")
pytest.importorskip("peft")


def _wrap(model, use_orig_params: bool, lora: bool):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from verl.utils.fsdp_utils import get_fsdp_wrap_policy

    policy = get_fsdp_wrap_policy(model, config={"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
                                  is_lora=lora)
    return FSDP(model, auto_wrap_policy=policy, use_orig_params=use_orig_params, device_id=torch.device("cpu"))


def _ppo_like(rank, world_size, use_orig_params):
    from verl.utils import fsdp_utils

    # verl's platform is CUDA unless it finds another accelerator: its load_fsdp_model_to_gpu asks it for the
    # device (cuda:N). On this CPU-only machine the test names the CPU instead; the rest is verl's code.
    fsdp_utils.get_device_name, fsdp_utils.get_device_id = (lambda: "cpu"), (lambda: 0)
    out = {}
    model = _wrap(tiny_llama(), use_orig_params, False)
    out["fsdp_version"] = fsdp_utils.fsdp_version(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(7)).chunk(world_size)[rank]
    losses = []
    for step in range(4):
        with torch.no_grad():  # the rollout's log-probs, then verl's reshard of the root
            losses.append(model(input_ids=ids).logits.float().mean())
            model._handle.reshard(True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        if step == 1:  # free the accelerator for the rollout, then take the model back
            # (torch FSDP1's FULL state dict segfaults on CPU after verl's offload round trip: taken before it)
            out["full"] = {k: v.clone() for k, v in fsdp_utils.get_fsdp_full_state_dict(
                model, offload_to_cpu=False, rank0_only=False).items()}
            fsdp_utils.offload_fsdp_model_to_cpu(model)
            fsdp_utils.offload_fsdp_optimizer(opt)
            fsdp_utils.load_fsdp_model_to_gpu(model)
            fsdp_utils.load_fsdp_optimizer(opt, "cpu")
    out["losses"] = torch.stack(losses).tolist()
    out["sharded"] = {k: v.clone() for k, v in fsdp_utils.fsdp1_sharded_save_to_cpu(model).items()}
    return out


def _lora(rank, world_size, use_orig_params):
    """verl's LoRA collection on the wrapped model, and what it must give: the unwrapped model's own (torch FSDP1's
    state-dict hook segfaults on CPU inside it, so the oracle is the single-process model)."""
    from peft.utils.save_and_load import get_peft_model_state_dict
    from verl.utils import fsdp_utils

    local = tiny_llama(lora=True)
    expected = {"whole": get_peft_model_state_dict(local), "layered": get_peft_model_state_dict(local),
                "base": {k.replace(".base_layer", ""): v for k, v in local.base_model.model.state_dict().items()
                         if "lora_" not in k}}
    model = _wrap(tiny_llama(lora=True), use_orig_params, True)
    got = {}
    for layered in (False, True):
        params = fsdp_utils.collect_lora_params(model, layered_summon=layered, base_sync_done=True)
        got["layered" if layered else "whole"] = {k: v.clone() for k, v in params.items()}
    got["base"] = {k: v.clone() for k, v in fsdp_utils.collect_lora_params(model, False, False).items()}
    return got, {k: {n: t.detach().clone() for n, t in v.items()} for k, v in expected.items()}


def _sharded_export(rank, world_size, use_orig_params):
    """verl's FSDP1 workers' weight sync to the rollout engine: a model built with a device mesh, its SHARDED
    state dict, each entry's ``full_tensor()``. Must be the unwrapped model's weights."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardedStateDictConfig, StateDictType
    from torch.distributed.tensor import DTensor
    from verl.utils.fsdp_utils import get_fsdp_wrap_policy

    local = tiny_llama()
    model = tiny_llama()
    policy = get_fsdp_wrap_policy(model, config={"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    model = FSDP(model, auto_wrap_policy=policy, use_orig_params=use_orig_params, device_id=torch.device("cpu"),
                 device_mesh=init_device_mesh("cpu", (world_size,)))
    FSDP.set_state_dict_type(model, state_dict_type=StateDictType.SHARDED_STATE_DICT,
                             state_dict_config=ShardedStateDictConfig())
    params = model.state_dict()
    assert all(isinstance(v, DTensor) for v in params.values()), {k: type(v) for k, v in params.items()}
    return {k: v.full_tensor().clone() for k, v in params.items()}, {k: v.clone() for k, v in local.state_dict().items()}


def _both(rank, world_size, use_orig_params):
    import flatshard

    def run(impl):
        got = _ppo_like(rank, world_size, use_orig_params)
        got["is_flatshard"] = flatshard.is_active()
        if impl == "flatshard":
            got["lora"], got["lora_expected"] = _lora(rank, world_size, use_orig_params)
            got["export"], got["export_expected"] = _sharded_export(rank, world_size, use_orig_params)
        return got

    got = torch_then_flatshard(run)
    for key in ("lora", "lora_expected", "export", "export_expected"):
        got[key] = got["flatshard"].pop(key)
    return got


def _same(ours, theirs, what):
    assert ours.keys() == theirs.keys(), f"{what}: keys {sorted(ours)} vs torch {sorted(theirs)}"
    for key, value in ours.items():
        torch.testing.assert_close(value, theirs[key], rtol=RTOL, atol=ATOL, msg=f"{what}: {key}")


@pytest.mark.parametrize("use_orig_params", [True, False])
def test_verl_fsdp_utils_as_torch_fsdp1(use_orig_params):
    for rank, got in enumerate(run_distributed(_both, 2, use_orig_params, timeout=240)):
        ours, theirs = got["flatshard"], got["torch"]
        assert ours["is_flatshard"] and not theirs["is_flatshard"]
        assert ours["fsdp_version"] == theirs["fsdp_version"] == 1
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]), rtol=RTOL, atol=ATOL,
                                   msg=f"rank {rank}: losses {ours['losses']} vs torch {theirs['losses']}")
        _same(ours["full"], theirs["full"], "get_fsdp_full_state_dict")
        # (With use_orig_params=False torch registers a unit's flat parameter on the module it wraps
        # (`..._fsdp_wrapped_module._flat_param`), flatshard on the unit (`..._flat_param`).)
        torch_names = {k.replace("_fsdp_wrapped_module._flat_param", "_flat_param"): v
                       for k, v in theirs["sharded"].items()}
        _same(ours["sharded"], torch_names, "fsdp1_sharded_save_to_cpu")
        _same(got["export"], got["export_expected"], "SHARDED state dict, full_tensor()")
        for kind in ("whole", "layered", "base"):
            assert got["lora"][kind], f"collect_lora_params ({kind}) returned nothing"
            _same(got["lora"][kind], got["lora_expected"][kind], f"collect_lora_params ({kind})")
