"""``flatshard.fully_shard`` against torch's FSDP2 (``torch.distributed.fsdp.fully_shard``) on the same script.

The oracle is torch's FSDP2 itself: each case builds the same model twice on every rank, shards one with
torch's ``fully_shard`` and one with flatshard's (blocks first, then the root, as FSDP2 users do), trains both
three Adam steps on the same rows of the same global batch, and compares per-step losses, the last step's
gradients (each rank's local tensor of each DTensor ``.grad``) and the final parameters (each rank's local
tensor). Results are bit-equal, fp32 and bf16 (``MixedPrecisionPolicy``) alike: both lay each parameter's
dim-0 chunks out the same way (see [Note: Dim-0 layout] in csrc/flatshard/layout.h), cast them the same way,
sum them with gloo's reduce-scatter and divide by a power of two.

``compiled_blocks`` compiles each block after sharding it, as torchtitan does, with dynamo and AOT autograd
(``backend="aot_eager"``): what meets flatshard's hooks is dynamo's tracing and the compiled forward and
backward graphs; inductor's code generation inside a block is the same for either FSDP and costs tens of
seconds on two cores (run by hand with ``backend="inductor"`` at W = 2, 2026-11-27: bit-equal too).

``compiled_root`` compiles the root module before its first forward (torch's test_fully_shard_training_compile.py
does), so that flatshard's lazy initialization meets dynamo.

``cpu_offload`` (``CPUOffloadPolicy``) goes through the front-end's path and the runtime's offload flag; on a
CPU the host is the device, so no copy is made, by torch or by flatshard: the copies run on a GPU
(tests/test_gpu.py).

The GPT has a vocabulary of 67 rows and a position table of 10: neither divides by 2 or 4, so ranks hold
padded chunks, and at W = 4 the position table's last rank holds 1 row of 3. Every case of one world size
runs in one process start (see [Note: One process start per world size] in tests/_cases.py).

The rest of fully_shard's tests against torch's FSDP2, on models this file's ``_build`` makes: what a script sees
(test_fully_shard_surface.py), state and checkpoints (test_fully_shard_state.py), gradients beyond one backward
a step (test_fully_shard_gradients.py).
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from _cases import CaseRun
from models import gpt_loss, local_slice, make_batch, make_gpt

VOCAB, SEQ, STEPS, LR = 67, 10, 3, 1e-2
CASES = ["reshard_after_forward=None", "reshard_after_forward=True", "reshard_after_forward=False",
         "no_gradient_sync", "checkpointed_blocks", "frozen_embedding", "ignored_position_table", "meta_then_to_empty",
         "bf16_params_fp32_reduce", "bf16_params_and_reduce", "bf16_fp32_outputs", "fp16_params_and_reduce",
         "bf16_params_fp32_reduce_no_gradient_sync", "compiled_blocks", "compiled_root", "cpu_offload",
         "frozen_base_weights",
         "tail_group", "tail_group_resharding", "tail_group_bf16_params_fp32_reduce", "explicit_prefetch",
         "divide_factor_summed", "kept_after_backward", "kept_after_backward_synced", "cast_to_float64_after",
         "cast_with_gradients",
         "matrices_on_dim_1", "all_reduce_hook", "fp16_all_reduce_hook", "half_model", "no_forward_prefetch",
         "hsdp_1x2_reduce_scatter_only_all_reduce_hook", "frozen_base_weights_all_reduce_hook",
         "two_reduce_scatters_in_flight", "separate_reduce_scatter_group", "optimizer_in_backward",
         "optimizer_in_backward_no_gradient_sync", "optimizer_in_backward_cpu_offload"]
WORLD_SIZES = [1, 2, 4]
# What block 0's pre-forward has issued (see [Note: Forward prefetch where the host is the device]): the block
# checked, from which forward on, and whether it is gathered by then. Implicit: the next block in the previous
# iteration's order (from the second forward); explicit: the two blocks given (from the first); none.
FORWARD_PREFETCH = {"reshard_after_forward=True": (1, 2, True), "explicit_prefetch": (2, 1, True),
                    "no_forward_prefetch": (1, 1, False)}
# At W = 1 a unit is replicated (nothing gathered, no copy-out): the cases whose code differs there.
W1_CASES = ["reshard_after_forward=None", "no_gradient_sync", "bf16_params_fp32_reduce", "meta_then_to_empty",
            "divide_factor", "optimizer_in_backward"]
# At W = 4 every unit's last rank holds fewer rows than the others (the position table's 1 row of 3): the cases
# whose code or arithmetic depends on the world size beyond that (the gathers and reductions of each resharding
# and precision path, no_sync, sharding on meta; fp16's divide factors); the rest (frozen, ignored and
# checkpointed parameters, bf16 outputs) go through the same code at W = 2.
W4_CASES = ["reshard_after_forward=None", "reshard_after_forward=False", "no_gradient_sync", "meta_then_to_empty",
            "bf16_params_fp32_reduce", "fp16_params_and_reduce", "frozen_base_weights", "reshard_after_forward=2",
            "reshard_after_forward=2_bf16", "matrices_on_dim_1", "half_model_all_reduce_hook",
            "optimizer_in_backward_no_gradient_sync"]
# At W = 4 only: HSDP on a 2x2 mesh (replicate, shard), resharding after forward or not.
HSDP_CASES = ["hsdp_2x2", "hsdp_2x2_reshard_after_forward=False", "hsdp_2x2_reduce_scatter_only",
              "hsdp_2x2_all_reduce_hook"]


def _cases_at(world_size: int) -> list[str]:
    return {1: W1_CASES, 2: CASES, 4: W4_CASES + HSDP_CASES}[world_size]


def _build(impl: str, case: str) -> nn.Module:
    if impl == "flatshard":
        from flatshard import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    if case == "meta_then_to_empty":  # torchtitan's way: shard on meta, to_empty, then initialize in place
        with torch.device("meta"):
            model = make_gpt(vocab=VOCAB, seq=SEQ, seed=0)
    else:
        model = make_gpt(vocab=VOCAB, seq=SEQ, seed=0)
    kwargs = {}
    if case.startswith("reshard_after_forward="):  # (=2: to pairs of ranks, at W = 4)
        kwargs["reshard_after_forward"] = {"None": None, "True": True, "False": False, "2": 2,
                                           "2_bf16": 2}[case.split("=")[1]]
    if case.endswith("_bf16"):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    if case.startswith("bf16") or case.startswith("tail_group_bf16"):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32 if "fp32_reduce" in case else None,
            output_dtype=torch.float32 if case == "bf16_fp32_outputs" else None)
    if case.startswith("fp16"):  # reduced in fp16: divided before and after the SUM, as torch's
        from torch.distributed.fsdp import MixedPrecisionPolicy

        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.float16)
    if case.startswith("hsdp"):
        from torch.distributed.device_mesh import init_device_mesh

        # (1x2: a replicate dim of one rank, HSDP still: the all-reduce and its hook wait for set_requires_all_reduce)
        shape = (1, 2) if case.startswith("hsdp_1x2") else (2, 2)
        kwargs["mesh"] = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        kwargs["reshard_after_forward"] = not case.endswith("=False")
    if case.startswith("kept_after_backward"):  # (torch's own test pairs set_reshard_after_backward with this)
        kwargs["reshard_after_forward"] = False
    if case == "matrices_on_dim_1":  # every matrix's chunk along dim 1 (its columns divide by 2 and 4), 1-D ones on 0
        from torch.distributed.tensor import Shard

        kwargs["shard_placement_fn"] = lambda p: Shard(1) if p.ndim == 2 else None
    if case.endswith("cpu_offload"):  # (no pinning without a GPU, torch's and ours)
        from torch.distributed.fsdp import CPUOffloadPolicy

        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    if case.startswith("half_model"):  # no policy: reduced in the parameters' fp16, divided before and after the SUM, as
        model.half()  # torch's (at W = 4 by 2 and 2: where the hook runs shows)
    if case == "frozen_embedding":
        model.embed.weight.requires_grad_(False)
    if case.startswith("frozen_base_weights"):  # LoRA's shape: each block's projection weights frozen, the rest trained
        for block in model.blocks:
            for linear in (block.attn.qkv, block.attn.proj, block.mlp.fc, block.mlp.out):
                linear.weight.requires_grad_(False)
    if case == "ignored_position_table":
        kwargs["ignored_params"] = {model.pos}
    if case == "checkpointed_blocks":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    block_kwargs = {k: v for k, v in kwargs.items() if k != "ignored_params"}
    if case == "bf16_fp32_outputs":  # the root's outputs only (a block's fp32 output would meet bf16 weights)
        from torch.distributed.fsdp import MixedPrecisionPolicy

        block_kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    if case.startswith("compiled_"):
        import torch._dynamo as dynamo

        dynamo.reset()
    for i, block in enumerate(model.blocks):
        fully_shard(block, **block_kwargs)
        if case == "compiled_blocks":  # torchtitan's way: each block compiled after fully_shard (see the docstring)
            model.blocks[i] = torch.compile(block, backend="aot_eager")
    if case.startswith("tail_group"):  # accelerate's FSDP2 tail: one unit of the final norm and the tied embedding
        # and head (a list of modules); torch's holds it from the first member's forward to the last one's, ours
        # gathers it again for a member after another resharded it (see [Note: A list of modules])
        # (bf16: the tied weight's two uses summed in bf16 before the fp32 reduction, as torch's autograd sums them
        # on its unsharded parameter: see [Note: FSDP2's gradient sums] in csrc/flatshard/flat_param.h)
        fully_shard([model.ln_f, model.embed, model.head], reshard_after_forward=case.endswith("resharding"),
                    **{k: v for k, v in kwargs.items() if k == "mp_policy"})
    fully_shard(model, **kwargs)
    if case == "compiled_root":  # torch's test_fully_shard_training_compile's way: the root compiled before its first
        # forward, whose lazy init then runs under dynamo. (Put in __dict__: an attribute set the usual way would make
        # the compiled wrapper a child module of the model it wraps.)
        model.__dict__["compiled"] = torch.compile(model, backend="aot_eager")
    if case == "explicit_prefetch":  # torchtitan's, one block further: each block gathers the next two in forward,
        # the previous one in backward
        for i, block in enumerate(model.blocks):
            block.set_modules_to_forward_prefetch(list(model.blocks[i + 1:i + 3]))
            block.set_modules_to_backward_prefetch(list(model.blocks[max(i - 1, 0):i]))
    if case == "two_reduce_scatters_in_flight":  # torchtitan's MoE routers' setting, here on every unit
        model.set_reduce_scatter_max_input_buffers(2)
    if case == "separate_reduce_scatter_group":
        model.set_separate_reduce_scatter_group()
    if case == "no_forward_prefetch":  # an empty list: no prefetch in forward (on the CPU too)
        for m in [model, *model.blocks]:
            m.set_modules_to_forward_prefetch([])
    if "all_reduce_hook" in case:  # torchft's use: each reduced shard changed in place; scaled and shifted, so
        # that where it runs against the division shows (after it in fp32, where torch divides inside its collectives;
        # before it in fp16, where torch sums, then divides)
        model.hook_calls = []
        for m in [model, *model.blocks]:
            m.set_all_reduce_hook(functools.partial(_scale_and_shift, model.hook_calls))
    if case.startswith("divide_factor"):  # divided by 3; summed: SUM, then divided (torch's PREMUL_SUM, unforced, is
        # NCCL's alone: unsummed at W = 1 only, where nothing is reduced; summed at W > 1 only, as torch's FSDP2 2.13
        # divides by the factor twice at W = 1 there, see README's differences)
        for m in [model, *model.blocks]:
            m.set_force_sum_reduction_for_comms(case.endswith("summed"))
            m.set_gradient_divide_factor(3.0)
    if case == "cast_to_float64_after":  # the shards, their gradients and the parameters' DTensors follow
        model.to(torch.float64)
    if case == "meta_then_to_empty":
        from torch.distributed.tensor import distribute_tensor

        model.to_empty(device="cpu")
        reference = make_gpt(vocab=VOCAB, seq=SEQ, seed=0)
        with torch.no_grad():
            for p, want in zip(model.parameters(), reference.parameters()):
                p.copy_(distribute_tensor(want, p.device_mesh, p.placements))
            for b, want in zip(model.buffers(), reference.buffers()):
                b.copy_(want)
    return model


def _scale_and_shift(calls: list, reduce_output: torch.Tensor) -> None:
    calls.append((str(reduce_output.dtype), reduce_output.numel()))
    reduce_output.mul_(0.5).add_(1e-3)


def _train(model: nn.Module, case: str, rank: int, world_size: int) -> dict:
    # (fp16 parameters: SGD, as Adam's eps underflows in fp16 and both runs would be NaN from the second step)
    opt = (torch.optim.SGD if case.startswith("half_model") else torch.optim.Adam)(
        [p for p in model.parameters() if p.requires_grad], lr=LR)
    losses, grads = [], []
    if case.startswith("optimizer_in_backward"):
        _step_in_backward(model)
    for step in range(STEPS):
        if case.startswith("optimizer_in_backward"):
            model.grads_in_hooks.clear()
        tokens, targets = local_slice(make_batch(batch=8, seq=SEQ, vocab=VOCAB, seed=step), rank, world_size)
        if case.endswith(("no_gradient_sync", "kept_after_backward", "kept_after_backward_synced")) or \
                "reduce_scatter_only" in case:
            # Two micro-batches, the first without reduction (kept: its parameters kept unsharded too, so that the
            # second forward gathers nothing; reduce-scatter only: HSDP's all-reduce left to the second)
            first_flags, last_flags = _accumulation_flags(case)
            for setter, value in first_flags:
                getattr(model, setter)(value)
            loss = gpt_loss(model, tokens[:, :5], targets[:, :5]) / 2
            loss.backward()
            for setter, value in last_flags:
                getattr(model, setter)(value)
            second = gpt_loss(model, tokens[:, 5:], targets[:, 5:]) / 2
            second.backward()
            loss = loss + second
        else:
            loss = gpt_loss(model.__dict__.get("compiled", model), tokens, targets)
            loss.backward()
        if case == "cast_with_gradients" and step == 0:  # (.float() of an fp32 model with gradients: a no-op, as
            model.float()  # torch's; a cast to another dtype after the first forward fails in torch's FSDP2 2.13)
        grads = [None if p.grad is None else _local(p.grad).clone() for p in model.parameters()]
        if case.startswith("optimizer_in_backward"):  # (every .grad None: each was stepped and zeroed in its hook)
            grads = [model.grads_in_hooks.get(name) for name, _ in model.named_parameters()]
            model.post_accumulate_calls.append(None)  # (a step's end)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "params": [_local(p).detach().clone() for p in model.parameters()],
            "names": [n for n, _ in model.named_parameters()]}


def _step_in_backward(model: nn.Module) -> None:
    """torchtune's optimizer in backward: a per-parameter Adam stepped and zeroed in each parameter's
    post-accumulate-grad hook; the hooks' calls (parameter names, in order) and the gradients they saw are kept."""
    names = {p: name for name, p in model.named_parameters()}
    optimizers = {p: torch.optim.Adam([p], lr=LR) for p in model.parameters() if p.requires_grad}
    model.post_accumulate_calls, model.grads_in_hooks = [], {}

    def step(p: torch.Tensor) -> None:
        model.post_accumulate_calls.append(names[p])
        model.grads_in_hooks[names[p]] = _local(p.grad).clone()
        optimizers[p].step()
        optimizers[p].zero_grad()

    for p in optimizers:
        p.register_post_accumulate_grad_hook(step)


def _accumulation_flags(case: str) -> tuple[list, list]:
    """The FSDPModule setters called before the first micro-batch and before the last (torch's gradient
    accumulation test's)."""
    setter = next((setter for key, setter in (("kept_after_backward", "set_reshard_after_backward"),
                                              ("reduce_scatter_only", "set_requires_all_reduce")) if key in case), None)
    # (kept, synced: each micro-batch reduced, the parameters kept unsharded between them)
    alone = setter == "set_requires_all_reduce" or case == "kept_after_backward_synced"
    flags = [setter] if alone else ["set_requires_gradient_sync"] + [setter] * bool(setter)
    return [(f, False) for f in flags], [(f, True) for f in flags]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _parity(rank: int, world_size: int, case: str) -> list[str]:
    """Problems found (empty: flatshard's run equals torch FSDP2's bit for bit)."""
    from flatshard import _C

    torch_model = _build("torch", case)
    theirs = _train(torch_model, case, rank, world_size)
    model = _build("flatshard", case)
    problems = []
    if case in FORWARD_PREFETCH and world_size > 1:
        ahead, first_forward, gathered = FORWARD_PREFETCH[case]
        forwards = []

        def check(_module, _args):  # (a pre-hook registered after fully_shard's: runs once it issued the prefetch)
            forwards.append(None)
            state = model.blocks[ahead]._unit_state.handle.state
            if len(forwards) >= first_forward and (state != _C.ShardedState.SHARDED) != gathered:
                problems.append(f"forward {len(forwards)}: block {ahead} is {state} at block 0's pre-forward; "
                                f"it should {'' if gathered else 'not '}have been gathered")

        model.blocks[0].register_forward_pre_hook(check)
    _C.reset_collective_counts()
    ours = _train(model, case, rank, world_size)
    if ours["names"] != theirs["names"]:
        problems.append(f"parameter names {ours['names']} != torch's {theirs['names']}")
    if ours["losses"] != theirs["losses"]:
        problems.append(f"losses {ours['losses']} != torch's {theirs['losses']}")
    for what in ("grads", "params"):
        for name, a, b in zip(theirs["names"], ours[what], theirs[what]):
            if (a is None) != (b is None) or (a is not None and not (a.shape == b.shape and torch.equal(a, b))):
                diff = "" if a is None or b is None or a.shape != b.shape else f", max |diff| {(a - b).abs().max():.2e}"
                problems.append(f"{what[:-1]} {name}: {None if a is None else tuple(a.shape)} vs torch's "
                                f"{None if b is None else tuple(b.shape)}{diff}")
    if _C.unsharded_bytes() != 0:
        problems.append(f"{_C.unsharded_bytes()} bytes unsharded between iterations")
    if case.startswith("reshard_after_forward=2"):
        # Each step gathers each unit twice: in forward its 1/W shard over all W ranks, in backward the 2/W it kept
        # over its pair of ranks (see [Note: Reshard to a smaller group] in csrc/flatshard/flat_param.h).
        element = 2 if case.endswith("bf16") else 4
        for name, unit in [("root", model)] + [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]:
            handle = unit._unit_state.handle
            want = STEPS * 3 * handle.layout.shard_numel * element
            if handle.collective_bytes["all_gather"] != want:
                problems.append(f"{name} all-gathered {handle.collective_bytes['all_gather']} bytes in {STEPS} steps, "
                                f"not {want} (its shard in forward, twice that in backward)")
    if case.startswith("optimizer_in_backward") and model.post_accumulate_calls != torch_model.post_accumulate_calls:
        problems.append(f"the post-accumulate-grad hooks ran for {model.post_accumulate_calls}, torch's for "
                        f"{torch_model.post_accumulate_calls}")
    if "all_reduce_hook" in case and sorted(model.hook_calls) != sorted(torch_model.hook_calls):
        problems.append(f"the all-reduce hooks saw {sorted(model.hook_calls)}, torch's {sorted(torch_model.hook_calls)}")
    if case == "separate_reduce_scatter_group" and world_size > 1:  # every reduce-scatter over the group of their own
        counts = _C.collective_counts()
        scatter = model._unit_state.reduce_scatter_group.group_name
        on_own = counts.get(scatter, {}).get("reduce_scatter", (0, 0))[0]
        elsewhere = sum(kinds["reduce_scatter"][0] for name, kinds in counts.items() if name != scatter)
        if on_own != STEPS * 4 or elsewhere or any(b._unit_state.reduce_scatter_group is not
                                                   model._unit_state.reduce_scatter_group for b in model.blocks):
            problems.append(f"{on_own} reduce-scatters over the separate group (not {STEPS * 4}), {elsewhere} elsewhere")
    if case == "two_reduce_scatters_in_flight" and model._unit_state.root.scheduler.max_reductions_in_flight != 2:
        problems.append(f"{model._unit_state.root.scheduler.max_reductions_in_flight} reductions in flight, not 2")
    if case == "matrices_on_dim_1":
        dims = {p.placements[-1].dim for p in model.parameters() if p.ndim == 2}
        if dims != {1}:
            problems.append(f"the matrices are sharded on dims {dims}, not 1")
    if case == "cast_to_float64_after":
        dtypes = {str(t.dtype) for t in ours["grads"] + ours["params"]} | {str(p.dtype) for p in model.parameters()}
        if dtypes != {"torch.float64"}:
            problems.append(f"after .to(torch.float64) the parameters and gradients are {sorted(dtypes)}")
    if case in ("kept_after_backward", "hsdp_2x2_reduce_scatter_only") and world_size > 1:
        # Kept after backward: each unit gathered once a step, in the first micro-batch's forward. Reduce-scatter
        # only: each unit reduce-scattered in both micro-batches, all-reduced over the replicas once a step.
        for name, unit in [("root", model)] + [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]:
            handle = unit._unit_state.handle
            shard_bytes = handle.layout.shard_numel * 4
            got, shard_factor = handle.collective_bytes, handle.layout.shard_factor
            want = ({"all_gather": STEPS * shard_bytes} if case == "kept_after_backward" else
                    {"reduce_scatter": 2 * STEPS * shard_bytes * shard_factor, "replica_all_reduce": STEPS * shard_bytes})
            for kind, n in want.items():
                if got[kind] != n:
                    problems.append(f"{name}: {kind} moved {got[kind]} bytes in {STEPS} steps, not {n}")
    if case == "frozen_base_weights" and world_size > 1:
        # Only the trainable parameters' rows are reduce-scattered (their padded rows on every rank), as torch's.
        for i, block in enumerate(model.blocks):
            handle, layout = block._unit_state.handle, block._unit_state.handle.layout
            rows = sum(layout.rows_per_shard(j) * layout.row_numel(j) for j, p in
                       enumerate(block._unit_state.orig_params) if p.requires_grad)
            got = handle.collective_bytes["reduce_scatter"]
            if got != STEPS * rows * world_size * 4:
                problems.append(f"block {i} reduce-scattered {got} bytes in {STEPS} steps, not "
                                f"{STEPS} x {rows * world_size * 4} (its trainable rows)")
    return problems


def _cases_of(world_size: int):
    return world_size, [(case, case) for case in _cases_at(world_size)]


RUNS = CaseRun(_parity, _cases_of, timeout=300.0, pg_timeout=30.0)


@pytest.mark.parametrize("case, world_size", [(c, w) for w in WORLD_SIZES for c in _cases_at(w)])
def test_same_training_as_torch_fsdp2(case, world_size):
    problems = [f"rank {rank}: " + "\n  ".join(p) for rank, p in enumerate(RUNS.results(world_size, case)) if p]
    assert not problems, f"{case} at W={world_size}:\n" + "\n".join(problems)
