"""What the framework tests share (tests/test_framework_*.py, test_hf_sft.py, test_generate_synced.py).

[Note: Forcing a framework's FSDP path on a CPU]
accelerate takes FSDP only on accelerator types (DDP on a CPU) and passes ``device_id=cpu:0``,
which torch's FSDP1 refuses; its FSDP plugin refuses ``sync_module_states`` without an
accelerator (it makes a ``param_init_fn`` for the accelerator's device), and loads FULL
checkpoints only with it. ``force_accelerate_fsdp`` sets what accelerate's AcceleratorState
sets on a GPU machine (``distributed_type = FSDP`` in its and PartialState's shared state,
the plugin) and the device ``cpu``, and ``sync_module_states`` after the plugin's
construction when FULL checkpoints are to be loaded (no ``param_init_fn`` is needed: the
model is not on the meta device). Everything else is the framework's own code.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable

import torch


def tiny_llama(lora: bool = False, **config_overrides):
    """A 2-layer Llama built from a config (random init, nothing downloaded), the same on every call."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
                            **config_overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        if lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                     init_lora_weights=False))
    return model


def set_launcher_environment(rank: int, world_size: int) -> None:
    """What torchrun sets, for frameworks that read it (the process group exists already)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), NODE_RANK="0", OMP_NUM_THREADS="1")


def reset_accelerate() -> None:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)


def force_accelerate_fsdp(state, plugin, full_loads: bool) -> None:
    """See [Note: Forcing a framework's FSDP path on a CPU]."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    state.device = PartialState._shared_state["device"] = torch.device("cpu")
    plugin.sync_module_states = full_loads
    state.fsdp_plugin = plugin


def torch_then_flatshard(run: Callable[[str], Any]) -> dict[str, Any]:
    """``run("torch")`` on torch's FSDP, then ``run("flatshard")`` with flatshard's opt-in installed (and uninstalled
    after), framework warnings silenced: the results by impl."""
    import flatshard

    got = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for impl in ("torch", "flatshard"):
            if impl == "flatshard":
                flatshard.install_as_torch_fsdp()
            try:
                got[impl] = run(impl)
            finally:
                flatshard.uninstall_as_torch_fsdp()
    return got


def accelerate_train(acc, model, opt, batches) -> list[torch.Tensor]:
    """accelerate's gradient-accumulation loop over ``batches`` (token ids, their own labels): each micro-batch's
    loss."""
    losses = []
    for ids in batches:
        with acc.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
        losses.append(loss.detach().float())
    return losses
