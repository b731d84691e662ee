"""flatshard.plan's memory per rank on language models shaped as users plan them (issue 34), against the measured peak.

Run with tests/memcount's malloc counter preloaded (see plan_memory_cases.py, whose method this follows), as one
rank (rank 3) of W-rank jobs under torch's fake process group: ``python plan_memory_lm_cases.py 8 64``. The model is
an HF ``LlamaForCausalLM`` from a small config (random init) whose vocabulary is large beside its width (4096 tokens,
64 wide, as a real model's 128k tokens beside 4096 wide sets its peak at the loss and the head), with an intermediate
width no world size divides (every unit pads). The shapes (``SHAPES``):
- ``root``: units are the decoder layers; the embedding and the untied head stay in the root; the loss outside the
  model (``F.cross_entropy`` of the logits);
- ``root_tied_loss_inside``: the same with the head tied to the embedding and the loss computed by the model
  (``labels=``);
- ``own_units``: the embedding and the head are units of their own too; loss inside;
- ``head_first``: as ``own_units``, with the head registered before the model's layers (its forward still runs
  last); loss outside.
Each for FULL_SHARD, SHARD_GRAD_OP and NO_SHARD, fp32 and bf16 mixed precision; one JSON line per case.
"""

import functools
import gc
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _memcount import MallocCounter  # noqa: E402

SHAPES = ("root", "root_tied_loss_inside", "own_units", "head_first")
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
DTYPES = ("fp32", "bf16")
BATCH, SEQ, VOCAB = 2, 32, 4096


def _model(shape, device=None):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=172, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         tie_word_embeddings=shape == "root_tied_loss_inside", attn_implementation="eager")
    with torch.device(device or "cpu"):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    if shape == "head_first":
        # (registration order only: its forward still runs the head last)
        model._modules = {"lm_head": model._modules["lm_head"], **{k: m for k, m in model._modules.items()
                                                                   if k != "lm_head"}}
    return model


def _policy(shape, model):
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, lambda_auto_wrap_policy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    if shape.startswith("root"):
        return ModuleWrapPolicy({LlamaDecoderLayer})
    own = {id(model.lm_head), id(model.model.embed_tokens)}
    return functools.partial(lambda_auto_wrap_policy,
                             lambda_fn=lambda m: isinstance(m, LlamaDecoderLayer) or id(m) in own)


def _batch():
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _loss_fn(shape):
    inputs, targets = _batch()
    if shape in ("root_tied_loss_inside", "own_units"):
        labels = torch.cat([inputs[:, :1], targets], dim=1)[:, :SEQ]  # (HF shifts the labels itself)
        return lambda model: model(input_ids=inputs, labels=labels).loss
    return lambda model: F.cross_entropy(model(input_ids=inputs).logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def measure_case(rank, world_size, shape, strategy_name, dtype):
    import flatshard
    from flatshard import MixedPrecision, ShardingStrategy
    from flatshard import FullyShardedDataParallel as FSDP

    counter = MallocCounter()
    strategy = ShardingStrategy[strategy_name]
    mixed = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if dtype == "bf16" else None
    loss_fn = _loss_fn(shape)
    activations = flatshard.plan.profile_activations(_model(shape), loss_fn,
                                                     dtype=torch.bfloat16 if mixed else None)

    def step(model, opt):
        loss_fn(model).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    gc.collect()
    before = counter.in_use()
    model = _model(shape)
    model = FSDP(model, auto_wrap_policy=_policy(shape, model), sharding_strategy=strategy, mixed_precision=mixed,
                 device_id=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters())  # (on a CPU: one tensor at a time, foreach=False)
    step(model, opt)
    gc.collect()
    counter.reset_peak()
    step(model, opt)
    measured = counter.peak() - before
    del model, opt
    gc.collect()
    meta = _model(shape, "meta")
    planned = flatshard.plan(meta, world_size, auto_wrap_policy=_policy(shape, meta), sharding_strategy=strategy,
                             mixed_precision=mixed, activation_bytes=activations, optimizer_foreach=False,
                             ranks_per_host=min(8, world_size), backend="fake", device="cpu")
    return {"case": f"W={world_size} {shape} {strategy_name} {dtype}", "rank": rank, "measured": measured,
            "planned": planned.memory.combined_peak, "activations": activations.peak,
            "plan": planned.memory.as_dict()}


def main(argv):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    sizes = [int(w) for w in argv if w.isdigit()]
    shapes = [s for s in argv if s in SHAPES] or SHAPES
    for i, world_size in enumerate(sizes):
        os.environ["LOCAL_WORLD_SIZE"] = str(min(8, world_size))
        rank = 3
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        if i == 0:  # what a process makes once, at its first wrap's first step, is no case's
            measure_case(rank, world_size, SHAPES[0], STRATEGIES[0], DTYPES[0])
            gc.collect()
            gc.freeze()
        for shape in shapes:
            for s in STRATEGIES:
                for d in DTYPES:
                    print(json.dumps(measure_case(rank, world_size, shape, s, d)), flush=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
