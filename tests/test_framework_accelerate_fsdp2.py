"""HF accelerate's own FSDP2 code (``fsdp_version=2``) on flatshard, through the opt-in (issue 32), against torch's
FSDP2.

Each rank runs accelerate's ``Accelerator.prepare`` with ``FullyShardedDataParallelPlugin(fsdp_version=2)`` on a
tiny Llama built from a config: its ``fsdp2_prepare_model`` calls ``torch.distributed.fsdp.fully_shard`` on each
decoder layer, on the list ``[norm, embed_tokens, lm_head]`` (one unit: the model's tail, tied embeddings here) and
on the root; ``mixed_precision="bf16"`` (its ``MixedPrecisionPolicy``), ``accelerator.accumulate`` over 2
micro-batches, ``save_state`` / ``load_state`` with SHARDED and FULL state dicts, ``get_state_dict``, and
``cpu_ram_efficient_loading`` (the model sharded on meta, then rank 0's weights broadcast into the shards). First
on torch's FSDP2, then with ``flatshard.install_as_torch_fsdp()`` on flatshard, in the same ranks: every loss, the
losses after resuming, and the full state dict must be torch's, bit for bit (flatshard's fully_shard is bit-equal
to torch's FSDP2 on gloo in fp32 and bf16, tests/test_fully_shard.py).

Forcing accelerate's FSDP path on a CPU: see [Note: Forcing a framework's FSDP path on a CPU] in
tests/_frameworks.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from flatshard.testing import run_distributed
from _frameworks import (accelerate_train, force_accelerate_fsdp, reset_accelerate, set_launcher_environment,
                         tiny_llama, torch_then_flatshard)

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

STEPS = 4  # micro-batches before the checkpoint (2 optimizer steps), and as many after


def _accelerator(rank, world_size, state_dict_type, cpu_ram_efficient_loading=False):
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    reset_accelerate()
    set_launcher_environment(rank, world_size)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, state_dict_type=state_dict_type, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"], cpu_ram_efficient_loading=cpu_ram_efficient_loading)
    acc = Accelerator(cpu=True, mixed_precision="bf16", fsdp_plugin=plugin, gradient_accumulation_steps=2)
    plugin.set_mixed_precision("bf16")
    force_accelerate_fsdp(acc.state, plugin, full_loads=False)
    return acc


def _prepare(acc, model):
    """FSDP2's way in accelerate: the model and its optimizer prepared together (accelerate swaps the optimizer's
    parameters for the DTensors)."""
    return acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))


def _is_flatshard(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    return bool(units) and all(getattr(m, "_is_flatshard_unit", False) for m in units)


def _run(rank, world_size, state_dict_type, ckpt_dir):
    acc = _accelerator(rank, world_size, state_dict_type)
    g = torch.Generator().manual_seed(1234)
    # Two different micro-batches per accumulation step; the second half repeats the first.
    batches = [ids.chunk(world_size)[rank] for ids in torch.randint(0, 128, (STEPS, 8, 16), generator=g)] * 2
    model, opt = _prepare(acc, tiny_llama(tie_word_embeddings=True))
    kind = (type(model).__name__, _is_flatshard(model))
    losses = accelerate_train(acc, model, opt, batches[:STEPS])
    acc.save_state(ckpt_dir)
    losses += accelerate_train(acc, model, opt, batches[STEPS:])
    full = {k: v.float().clone() for k, v in acc.get_state_dict(model).items()}
    acc.wait_for_everyone()

    acc2 = _accelerator(rank, world_size, state_dict_type)
    model2, opt2 = _prepare(acc2, tiny_llama(tie_word_embeddings=True))
    acc2.load_state(ckpt_dir)
    resumed = accelerate_train(acc2, model2, opt2, batches[STEPS:])
    out = torch.stack(losses + resumed)
    torch.distributed.all_reduce(out)
    return {"class": kind, "losses": (out / world_size).tolist(), "full": full}


def _efficient_loading_run(rank, world_size):
    """``cpu_ram_efficient_loading``: accelerate moves the model to meta, shards it there, and fills the shards from
    rank 0's state dict (``fsdp2_load_full_state_dict``); the other ranks' weights are different here, so only a
    load that really came from rank 0 trains as the reference."""
    acc = _accelerator(rank, world_size, "SHARDED_STATE_DICT", cpu_ram_efficient_loading=True)
    g = torch.Generator().manual_seed(99)
    batches = [torch.randint(0, 128, (8, 16), generator=g).chunk(world_size)[rank] for _ in range(STEPS)]
    model = tiny_llama(tie_word_embeddings=True)
    if rank != 0:
        with torch.no_grad():
            for p in model.parameters():
                p.uniform_(-1, 1)
    model, opt = _prepare(acc, model)
    out = torch.stack(accelerate_train(acc, model, opt, batches))
    torch.distributed.all_reduce(out)
    return {"class": _is_flatshard(model), "losses": (out / world_size).tolist()}


def _both(rank, world_size, tmp):
    def run(impl):
        got = {state_dict_type: _run(rank, world_size, state_dict_type, os.path.join(tmp, f"{state_dict_type}-{impl}"))
               for state_dict_type in ("SHARDED_STATE_DICT", "FULL_STATE_DICT")}
        got["efficient_loading"] = _efficient_loading_run(rank, world_size)
        return got

    return {(key, impl): value for impl, got in torch_then_flatshard(run).items() for key, value in got.items()}


def test_accelerate_fsdp2_bf16_accumulate_save_load_and_efficient_loading_as_torch_fsdp2(tmp_path):
    got = run_distributed(_both, 2, str(tmp_path), timeout=280)[0]
    for state_dict_type in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
        torchs, ours = got[state_dict_type, "torch"], got[state_dict_type, "flatshard"]
        assert torchs["class"] == ("FSDPLlamaForCausalLM", False), torchs["class"]
        assert ours["class"] == ("FSDPLlamaForCausalLM", True), ours["class"]  # flatshard's units, torch's classes
        expected = torch.tensor(torchs["losses"])
        assert expected[STEPS] < expected[0], f"loss did not fall on the same batch: {torchs['losses']}"
        torch.testing.assert_close(torch.tensor(ours["losses"]), expected, rtol=0, atol=0,
                                   msg=f"{state_dict_type}: losses {ours['losses']} vs torch {torchs['losses']}")
        assert ours["full"].keys() == torchs["full"].keys()
        for key, value in ours["full"].items():
            torch.testing.assert_close(value, torchs["full"][key], rtol=0, atol=0, msg=f"{state_dict_type}: {key}")
    torchs, ours = got["efficient_loading", "torch"], got["efficient_loading", "flatshard"]
    assert ours["class"] and not torchs["class"]
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(torchs["losses"]), rtol=0, atol=0,
                               msg=f"cpu_ram_efficient_loading: {ours['losses']} vs torch {torchs['losses']}")
