"""HF accelerate's own FSDP1 code on flatshard, through the opt-in (issue 19), against torch FSDP1.

Each rank runs accelerate's ``Accelerator.prepare`` (``FullyShardedDataParallelPlugin``,
``fsdp_version=1``, ``mixed_precision="bf16"``, a transformer wrap policy on a tiny
Llama built from a config), ``accelerator.accumulate`` over 2 micro-batches with
``accelerator.backward``, ``save_state`` / ``load_state`` with SHARDED and FULL state
dicts, and ``get_state_dict``; and, on a model loaded in bf16, accelerate's upcast of each
flat parameter to fp32 (``param.data = ...``, ``_handle._orig_param_dtype``); first on torch's FSDP1, then with
``flatshard.install_as_torch_fsdp()`` on flatshard, in the same ranks. The losses, the
losses after resuming from the checkpoint, and the full state dict must be torch's (bit
for bit: accelerate sets the same MixedPrecision for both, and flatshard's mixed
precision is bit-equal to torch FSDP1's on gloo, tests/test_mixed_precision.py).
torch FSDP1's FULL state dicts with ``offload_to_cpu`` (accelerate's FULL checkpoints and
``get_state_dict``) segfault on CPU in torch 2.13, so torch runs with SHARDED checkpoints
and gives its full state dict without offloading; flatshard runs both, and its FULL
resume must continue exactly as the run that went on. (accelerate's SHARDED resume does
not, on torch FSDP1 either: the second optimizer step after it differs; flatshard
matches torch there bit for bit.)

Forcing accelerate's FSDP path on a CPU: see [Note: Forcing a framework's FSDP path on a CPU] in
tests/_frameworks.py.
"""

from __future__ import annotations

import functools
import os
import warnings

import pytest
import torch

from flatshard.testing import run_distributed
from _frameworks import accelerate_train, force_accelerate_fsdp, reset_accelerate, set_launcher_environment, tiny_llama

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

STEPS = 4  # micro-batches before the checkpoint (2 optimizer steps), and as many after


def _accelerator(rank, world_size, use_orig_params, state_dict_type):
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    reset_accelerate()
    set_launcher_environment(rank, world_size)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=1, use_orig_params=use_orig_params, state_dict_type=state_dict_type,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer}))
    acc = Accelerator(cpu=True, mixed_precision="bf16", fsdp_plugin=plugin, gradient_accumulation_steps=2)
    plugin.set_mixed_precision("bf16")
    force_accelerate_fsdp(acc.state, plugin, full_loads=state_dict_type == "FULL_STATE_DICT")
    return acc


def _full_state_dict(acc, model, impl):
    """accelerate's ``get_state_dict`` (FULL, offloaded, on rank 0) on flatshard. On torch FSDP1 on CPU it
    segfaults (in torch's offload_to_cpu param hook, torch 2.13): the same state dict, not offloaded."""
    if impl == "flatshard":
        return acc.get_state_dict(model)
    from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel, StateDictType

    with FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig()):
        state = model.state_dict()
    return state if torch.distributed.get_rank() == 0 else {}


def _run(rank, world_size, use_orig_params, state_dict_type, ckpt_dir, impl):
    acc = _accelerator(rank, world_size, use_orig_params, state_dict_type)
    g = torch.Generator().manual_seed(1234)
    # Two different micro-batches per accumulation step (the same batch twice would hide one dropped or
    # doubled micro-batch from AdamW, which hardly sees the gradient's scale); the second half repeats the first.
    batches = [ids.chunk(world_size)[rank] for ids in torch.randint(0, 128, (STEPS, 8, 16), generator=g)] * 2
    model = acc.prepare(tiny_llama())
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    kind = (type(model).__name__, getattr(model, "_is_flatshard_unit", False))
    losses = accelerate_train(acc, model, opt, batches[:STEPS])
    acc.save_state(ckpt_dir)
    losses += accelerate_train(acc, model, opt, batches[STEPS:])
    full = {k: v.float().clone() for k, v in _full_state_dict(acc, model, impl).items()}
    acc.wait_for_everyone()

    acc2 = _accelerator(rank, world_size, use_orig_params, state_dict_type)
    model2 = acc2.prepare(tiny_llama())
    opt2 = acc2.prepare(torch.optim.AdamW(model2.parameters(), lr=1e-2))
    acc2.load_state(ckpt_dir)
    resumed = accelerate_train(acc2, model2, opt2, batches[STEPS:])
    out = torch.stack(losses + resumed)
    torch.distributed.all_reduce(out)
    return {"class": kind, "losses": (out / world_size).tolist(), "full": full}


def _upcast_run(rank, world_size, use_orig_params):
    """A model loaded in bf16 (as the Trainer and TRL load them): accelerate's prepare upcasts each flat parameter
    to fp32 (``param.data = param.data.to(float32)``, then ``_handle._orig_param_dtype``), then trains."""
    acc = _accelerator(rank, world_size, use_orig_params, "SHARDED_STATE_DICT")
    g = torch.Generator().manual_seed(99)
    batches = [torch.randint(0, 128, (8, 16), generator=g).chunk(world_size)[rank]] * STEPS
    model = acc.prepare(tiny_llama().to(torch.bfloat16))
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    out = torch.stack(accelerate_train(acc, model, opt, batches))
    torch.distributed.all_reduce(out)
    return {"dtypes": dtypes, "losses": (out / world_size).tolist()}


def _both(rank, world_size, use_orig_params, tmp):
    """torch FSDP1 with SHARDED checkpoints (its FULL ones segfault on CPU, see _full_state_dict), then flatshard
    with both."""
    import flatshard

    got = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for impl, state_dict_type in (("torch", "SHARDED_STATE_DICT"), ("flatshard", "SHARDED_STATE_DICT"),
                                      ("flatshard", "FULL_STATE_DICT")):
            if impl == "flatshard":
                flatshard.install_as_torch_fsdp()
            try:
                got[state_dict_type, impl] = _run(rank, world_size, use_orig_params, state_dict_type,
                                                  os.path.join(tmp, f"{state_dict_type}-{impl}"), impl)
                if state_dict_type == "SHARDED_STATE_DICT":
                    got["upcast", impl] = _upcast_run(rank, world_size, use_orig_params)
            finally:
                flatshard.uninstall_as_torch_fsdp()
    return got


@pytest.mark.parametrize("use_orig_params", [True, False])
def test_accelerate_prepare_bf16_accumulate_save_load_as_torch_fsdp1(use_orig_params, tmp_path):
    got = run_distributed(_both, 2, use_orig_params, str(tmp_path), timeout=280)[0]
    torchs = got["SHARDED_STATE_DICT", "torch"]
    assert torchs["class"] == ("FullyShardedDataParallel", False)
    expected = torch.tensor(torchs["losses"])
    assert expected[STEPS] < expected[0], f"loss did not fall on the same batch: {torchs['losses']}"
    for state_dict_type in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
        ours = got[state_dict_type, "flatshard"]
        assert ours["class"] == ("FullyShardedDataParallel", True)  # torch's class, flatshard's units
        losses = torch.tensor(ours["losses"])
        if state_dict_type == "SHARDED_STATE_DICT":  # trained, saved, went on, resumed: torch's losses, bit for bit
            torch.testing.assert_close(losses, expected, rtol=0, atol=0,
                                       msg=f"losses {ours['losses']} vs torch {torchs['losses']}")
        else:  # torch cannot save FULL here: trained as torch, and resumed exactly where the run went on
            torch.testing.assert_close(losses[:2 * STEPS], expected[:2 * STEPS], rtol=0, atol=0,
                                       msg=f"losses {ours['losses']} vs torch {torchs['losses']}")
            torch.testing.assert_close(losses[2 * STEPS:], losses[STEPS:2 * STEPS], rtol=0, atol=0,
                                       msg=f"resumed {ours['losses']}")
        assert ours["full"].keys() == torchs["full"].keys()
        for key, value in ours["full"].items():
            torch.testing.assert_close(value, torchs["full"][key], rtol=0, atol=0, msg=key)
    ours, torchs = got["upcast", "flatshard"], got["upcast", "torch"]
    # (torch's original parameters show the upcast only from their next forward on; flatshard's at once)
    assert ours["dtypes"] == ["torch.float32"], ours["dtypes"]
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(torchs["losses"]), rtol=0, atol=0,
                               msg=f"bf16-loaded model, upcast: {ours['losses']} vs torch {torchs['losses']}")


def _fp16_run(impl, rank, world_size):
    """accelerate's FSDP1 path with ``mixed_precision="fp16"``: it makes torch's ``ShardedGradScaler`` and steps
    through it (``acc.backward`` scales, ``opt.step`` unscales, skips on inf, updates the scale)."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    reset_accelerate()
    set_launcher_environment(rank, world_size)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=1, auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                           transformer_layer_cls={LlamaDecoderLayer}))
    acc = Accelerator(cpu=True, mixed_precision="fp16", fsdp_plugin=plugin)
    plugin.set_mixed_precision("fp16")
    force_accelerate_fsdp(acc.state, plugin, full_loads=False)
    if acc.scaler is None:  # (accelerate makes it only on a GPU: here by hand, as prepare() would there)
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        acc.scaler = ShardedGradScaler(device="cpu", init_scale=2.0**10, growth_interval=2)
        acc.native_amp = True
    g = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, 128, (8, 16), generator=g).chunk(world_size)[rank] for _ in range(STEPS)]
    model = acc.prepare(tiny_llama())
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    out = torch.stack(accelerate_train(acc, model, opt, batches))
    torch.distributed.all_reduce(out)
    return {"scaler": type(acc.scaler).__name__, "scale": float(acc.scaler.get_scale()),
            "losses": (out / world_size).tolist(), "class": getattr(model, "_is_flatshard_unit", False)}


def _fp16_both(rank, world_size):
    from _frameworks import torch_then_flatshard

    return torch_then_flatshard(lambda impl: _fp16_run(impl, rank, world_size))


def test_accelerate_fp16_with_sharded_grad_scaler_as_torch_fsdp1():
    """Issue 35, item 7: fp16 through accelerate's FSDP1 path (its ShardedGradScaler) trains as torch's FSDP1: the
    same losses and the same scale after the steps, bit for bit."""
    got = run_distributed(_fp16_both, 2, timeout=280)[0]
    assert got["torch"]["scaler"] == "ShardedGradScaler" and not got["torch"]["class"] and got["flatshard"]["class"]
    assert got["flatshard"]["scaler"] == "ShardedGradScaler"
    assert got["flatshard"]["losses"] == got["torch"]["losses"], got
    assert got["flatshard"]["scale"] == got["torch"]["scale"] != 2.0**10, got  # (stepped through the scaler: it grew)
