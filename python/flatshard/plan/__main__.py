"""``python -m flatshard.plan``: a plan from an HF config, without allocating the model.

    python -m flatshard.plan --hf-config path/to/config.json --world-size 64 \\
        [--strategy FULL_SHARD] [--mixed-precision bf16] [--cpu-offload] [--optimizer adamw] \\
        [--wrap LlamaDecoderLayer] [--ranks-per-host 8] [--no-sync] [--json] [--plot plan.png] \\
        [--batch-size 2 --seq-len 4096] [--network nvlink]

The model is built on the meta device from the config (``transformers``, nothing downloaded);
``--wrap`` names the classes to make units of (default: the model's ``_no_split_modules``,
its decoder layer). With ``--batch-size`` and ``--seq-len`` (one rank's batch) the activation term is
measured (see [Note: Measuring activations]): the same config with one and with two layers is
built for real (on the GPU when there is one, else the CPU) and stepped once each on random tokens,
and the difference per layer is extrapolated to the config's depth; else it is left out. The same
steps give the compute time (forward, backward, AdamW's step) that ``--network`` lays the
collectives against (see [Note: The timing model]); without a batch, ``--network`` gives the
collectives' time alone.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")


class _Parser(argparse.ArgumentParser):
    """Every bad input is one line naming it and the fix, exit status 2 (argparse's own errors included)."""

    def error(self, message: str):  # type: ignore[override]
        print(f"{self.prog}: {message}", file=sys.stderr)
        sys.exit(2)


def _check(parser: _Parser, args: argparse.Namespace) -> None:
    """What the arguments alone say is wrong, before anything is built."""
    if args.world_size < 1:
        parser.error(f"--world-size: expected a number of ranks >= 1 but got {args.world_size}")
    if args.strategy not in _STRATEGIES:
        parser.error(f"--strategy: expected one of {', '.join(_STRATEGIES)} but got {args.strategy!r}")
    if args.ranks_per_host < 1:
        parser.error(f"--ranks-per-host: expected >= 1 but got {args.ranks_per_host}")
    if "HYBRID" in args.strategy and args.world_size % args.ranks_per_host:
        parser.error(f"--strategy {args.strategy}: --world-size {args.world_size} is not a multiple of "
                     f"--ranks-per-host {args.ranks_per_host} (hybrid sharding shards within each host's ranks)")
    if args.api == "fully_shard" and args.strategy not in ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"):
        parser.error(f"--api fully_shard: --strategy {args.strategy} has no fully_shard equivalent (FULL_SHARD, "
                     f"SHARD_GRAD_OP: reshard_after_forward=False, HYBRID_SHARD: a 2-D mesh)")
    if (args.batch_size is None) != (args.seq_len is None):
        parser.error("--batch-size and --seq-len go together (one rank's batch)")
    if args.batch_size is not None and (args.batch_size < 1 or args.seq_len < 1):
        parser.error(f"--batch-size and --seq-len: expected >= 1 but got {args.batch_size} and {args.seq_len}")
    if not os.path.isfile(args.hf_config):
        parser.error(f"--hf-config: no file at {args.hf_config} (give the path of a model's config.json; nothing "
                     f"is downloaded)")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m flatshard.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-config", required=True, help="an HF model config.json (nothing is downloaded)")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--strategy", default="FULL_SHARD",
                        help="FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD or _HYBRID_SHARD_ZERO2")
    parser.add_argument("--mixed-precision", choices=["none", "bf16", "fp16"], default="none",
                        help="param_dtype and reduce_dtype (torch's MixedPrecision)")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="the parameters' dtype")
    parser.add_argument("--cpu-offload", action="store_true")
    parser.add_argument("--optimizer", default="adamw", help="adamw, adam, sgd, sgd_momentum or none")
    parser.add_argument("--wrap", nargs="*", help="module classes to make units of (default: _no_split_modules)")
    parser.add_argument("--ranks-per-host", type=int, default=8, help="hybrid sharding's shard group size")
    parser.add_argument("--use-orig-params", action="store_true")
    parser.add_argument("--api", choices=["class", "fully_shard"], default="class",
                        help="FullyShardedDataParallel, or fully_shard on each --wrap module then the root (--strategy "
                             "SHARD_GRAD_OP: reshard_after_forward=False; HYBRID_SHARD: a 2-D mesh)")
    parser.add_argument("--no-sync", action="store_true", help="the memory of accumulating with no_sync()")
    parser.add_argument("--batch-size", type=int, help="one rank's batch: measure the activation term (with --seq-len)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence of that batch")
    parser.add_argument("--network", choices=["nvlink", "infiniband"],
                        help="the step's time over this network (with --batch-size: against the measured compute)")
    parser.add_argument("--json", action="store_true", help="JSON instead of the table")
    parser.add_argument("--plot", metavar="PATH", help="also write a plot: memory per rank against world size for "
                                                       "each strategy, bytes per unit (needs matplotlib)")
    args = parser.parse_args(argv)
    _check(parser, args)  # (before torch is imported: one line, in a fraction of a second)

    import torch

    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers import AutoConfig, AutoModelForCausalLM

    from flatshard import plan as make_plan
    from flatshard.api import CPUOffload, MixedPrecision, ShardingStrategy

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    config = AutoConfig.from_pretrained(args.hf_config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtypes[args.dtype])
    wrap_names = args.wrap or list(getattr(model, "_no_split_modules", None) or [])
    classes = {type(m) for m in model.modules() if type(m).__name__ in wrap_names}
    if wrap_names and not classes:
        parser.error(f"--wrap: no module of the model is a {', '.join(wrap_names)}")
    mixed = None if args.mixed_precision == "none" else MixedPrecision(
        param_dtype=dtypes[args.mixed_precision], reduce_dtype=dtypes[args.mixed_precision])
    strategy = ShardingStrategy[args.strategy]  # (checked by _check)
    activations = compute = None
    if args.batch_size is not None:
        compute_dtype = mixed.param_dtype if mixed is not None else dtypes[args.dtype]
        try:
            activations, compute = _measured_step(config, args.batch_size, args.seq_len, compute_dtype)
        except (RuntimeError, MemoryError) as e:  # (the allocator's: a model too large to build here)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            parser.error(f"--batch-size: measuring the activations builds one and two layers of the model for real, "
                         f"which this machine cannot ({first[:200]}); plan without --batch-size and --seq-len (the "
                         f"activation term is then left out), or measure on a larger machine")

    def plan_at(world_size: int, strategy: ShardingStrategy):
        kwargs = dict(sharding_strategy=strategy, mixed_precision=mixed,
                      cpu_offload=CPUOffload(offload_params=args.cpu_offload), use_orig_params=args.use_orig_params)
        if args.api == "fully_shard":  # (see [Note: A fully_shard plan] in plan/__init__.py)
            from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

            if strategy not in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP,
                                ShardingStrategy.HYBRID_SHARD):
                parser.error(f"--api fully_shard: --strategy {strategy.name} has no fully_shard equivalent")
            kwargs = dict(
                api="fully_shard",
                sharding_strategy=ShardingStrategy.HYBRID_SHARD if strategy == ShardingStrategy.HYBRID_SHARD else None,
                reshard_after_forward=False if strategy == ShardingStrategy.SHARD_GRAD_OP else None,
                mixed_precision=None if mixed is None else MixedPrecisionPolicy(param_dtype=mixed.param_dtype,
                                                                                reduce_dtype=mixed.reduce_dtype),
                cpu_offload=CPUOffloadPolicy() if args.cpu_offload else None)
        return make_plan(
            model, world_size, auto_wrap_policy=ModuleWrapPolicy(classes) if classes else None, **kwargs,
            optimizer=args.optimizer, ranks_per_host=args.ranks_per_host,
            no_sync=args.no_sync, activation_bytes=activations, network=args.network, compute=compute)

    result = plan_at(args.world_size, strategy)
    print(result.dumps() if args.json else result.table())
    if args.plot:
        from flatshard.plan._plot import plot

        sizes = sorted({w for w in (8, 16, 32, 64, 128, 256, 512, 1024) if w <= max(8, args.world_size)}
                       | {args.world_size})
        plot(plan_at, sizes, args.plot)
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0


def _measured_step(config, batch: int, seq: int, dtype: torch.dtype) -> tuple[int, tuple[float, float, float]]:
    """The activation term and the compute seconds (forward, backward, AdamW's step) of the config's depth, from
    real steps of one and two layers (a decoder's layers are alike; what is outside them, the embeddings and the
    loss, is in both), extrapolated per layer."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from flatshard.plan import measure_activations, measure_compute

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    layers = config.num_hidden_layers
    activations, seconds = [], []
    for depth in (1, 2):
        shallow = copy.deepcopy(config)
        shallow.num_hidden_layers = depth
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(shallow, dtype=dtype)
        tokens = torch.randint(0, config.vocab_size, (batch, seq), device=device)
        loss = lambda m: m(input_ids=tokens, labels=tokens).loss  # noqa: E731
        # (the plan is for GPUs: a CPU standing in for one counts no CPU kernel's scratch)
        activations.append(measure_activations(model, loss, kernel_scratch=False))
        seconds.append(measure_compute(model, loss, torch.optim.AdamW(model.parameters()), repeats=3))
        del model
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "this host"
    print(f"flatshard.plan: activations and compute measured on {device} ({where}), {dtype}, one and two layers "
          f"extrapolated to {layers}", file=sys.stderr)
    per_layer = max(0, activations[1] - activations[0])
    compute = tuple(one + max(0.0, two - one) * (layers - 1) for one, two in zip(*seconds))
    return activations[0] + per_layer * (layers - 1), compute  # type: ignore[return-value]


if __name__ == "__main__":
    sys.exit(main())
