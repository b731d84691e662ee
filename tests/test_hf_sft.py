"""An HF-style SFT loop with ``use_orig_params=True``, against torch's FSDP1.

Acceptance (issue 9): a small ``transformers`` Llama built from a config (random init, no
download), wrapped with ``transformer_auto_wrap_policy`` on its decoder layer class, AdamW
with no-decay groups chosen by name after wrapping (biases and norms, as the HF Trainer
does), ``model.clip_grad_norm_``, the loss from the model's own forward with ``labels``:
the same per-step losses as torch's FSDP1 with ``use_orig_params=True`` at W = 1, 2, 4.

Tolerance rtol 1e-5: the clipping norm is a sum of squares whose order differs between the
implementations (flatshard sums per flat shard, torch per parameter), which moves the clip
coefficient by an ulp or so; everything else is the same arithmetic.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

from flatshard.testing import run_distributed
from _frameworks import tiny_llama
from models import fsdp_class, local_slice

STEPS = 4


def _sft(rank, world_size, impl) -> list[float]:
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    FSDP = fsdp_class(impl)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = FSDP(tiny_llama(), use_orig_params=True, device_id=torch.device("cpu"),
                     auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                        transformer_layer_cls={LlamaDecoderLayer}))
    no_decay = ("bias", "norm")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)], "weight_decay": 0.1},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=1e-3)
    g = torch.Generator().manual_seed(1234)
    input_ids = torch.randint(0, 128, (8, 16), generator=g)
    local = local_slice(input_ids, rank, world_size)
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=local, labels=local).loss
        loss.backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    losses = torch.stack(losses)
    torch.distributed.all_reduce(losses)
    return (losses / world_size).tolist()


def _both(rank, world_size):
    return {impl: _sft(rank, world_size, impl) for impl in ("torch", "flatshard")}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_hf_llama_sft_matches_torch_fsdp1(world_size):
    got = run_distributed(_both, world_size, timeout=240)[0]
    torch.testing.assert_close(torch.tensor(got["flatshard"]), torch.tensor(got["torch"]), rtol=1e-5, atol=0,
                               msg=f"losses {got['flatshard']} vs torch {got['torch']}")


def _forward_and_generate_in_summon(rank, world_size, use_orig_params) -> dict:
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from flatshard import FullyShardedDataParallel as FSDP

    reference = tiny_llama().eval()
    model = FSDP(tiny_llama(), use_orig_params=use_orig_params,
                 auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                    transformer_layer_cls={LlamaDecoderLayer}))
    model.eval()
    prompt = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(rank))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad(), FSDP.summon_full_params(model, writeback=False):
        logits = model(input_ids=prompt).logits
        generated = model.module.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    after = model.state_dict()
    with torch.no_grad():
        want_logits = reference(input_ids=prompt).logits
        want_generated = reference.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-6)
    assert torch.equal(generated, want_generated), f"{generated} vs {want_generated}"
    for k, v in before.items():
        assert torch.equal(after[k], v), f"'{k}' changed"
    # And training goes on afterwards.
    model.train()
    model(input_ids=prompt, labels=prompt).loss.backward()
    return True


@pytest.mark.parametrize("use_orig_params", [True, False])
def test_forward_and_generate_inside_summon_full_params(use_orig_params):
    run_distributed(_forward_and_generate_in_summon, 2, use_orig_params, timeout=240)
