"""transformers' ``generate()`` on a flatshard model when ranks stop at different steps (issue 19).

The pattern of RL and evaluation loops on FSDP1 (TRL's FSDP1 generation): the root's own
parameters summoned (``summon_full_params(model, recurse=False)``), the decoder layers
staying units that all-gather in each forward, and ``generate()`` on the wrapped HF model.
One rank's prompt hits its end-of-sequence token after two tokens, the other's never: a
rank that stopped would leave its peer's all-gathers unpaired (a hang), unless
``generate`` keeps stepping in lockstep, which it does (``synced_gpus``) when it finds
``_is_fsdp_managed_module`` on the model, as flatshard sets it on every module a unit
manages (as torch's FSDP1 does). Every rank's tokens must be those of a single-process
``generate`` on the unwrapped model with the same prompt and settings (greedy, fp32).
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

from flatshard.testing import run_distributed
from _frameworks import tiny_llama

pytest.importorskip("transformers")

NEW_TOKENS = 8


def _llama():
    return tiny_llama(pad_token_id=0).eval()


def _generate(model, prompt, eos):
    return model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=0,
                          attention_mask=torch.ones_like(prompt))


def _run(rank, world_size, use_orig_params):
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from flatshard import FullyShardedDataParallel as FSDP

    prompt = torch.randint(1, 128, (1, 6), generator=torch.Generator().manual_seed(10 + rank))
    local = _llama()
    free_run = _generate(local, prompt, eos=None)[0, prompt.shape[1]:]
    # Rank 0 stops after its second token; the others run all NEW_TOKENS steps.
    eos = int(free_run[1]) if rank == 0 else None
    expected = _generate(local, prompt, eos)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = FSDP(_llama(), use_orig_params=use_orig_params, device_id=torch.device("cpu"),
                     auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                        transformer_layer_cls={LlamaDecoderLayer}))
        with FSDP.summon_full_params(model, recurse=False, writeback=False):
            got = _generate(model.module, prompt, eos)
    return got, expected


@pytest.mark.parametrize("use_orig_params", [True, False])
def test_generate_with_ranks_stopping_at_different_steps(use_orig_params):
    results = run_distributed(_run, 2, use_orig_params, timeout=120)
    for rank, (got, expected) in enumerate(results):
        assert torch.equal(got, expected), f"rank {rank}: {got.tolist()} vs single process {expected.tolist()}"
    assert results[0][0].shape[1] < results[1][0].shape[1], "rank 0 did not stop early: the test lost its point"
