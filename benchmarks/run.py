"""flatshard against torch FSDP2, torch FSDP1, DDP and plain local training.

    python benchmarks/run.py             # everything: table, JSON, plots, RESULTS.md (~5 min on 2 cores)
    python benchmarks/run.py --quick     # smoke run: few steps, into benchmarks/out/ only
    python benchmarks/run.py --profile   # Chrome trace of one flatshard step (benchmarks/out/trace/)
    python benchmarks/run.py --workloads gpt,memory

CPU: gloo, one thread per rank, world size 2 for timing (and 1 against local
training). GPU: NCCL at world size 1. Memory at W = 1, 2, 4 (as many as there
are devices on GPU). See benchmarks/README.md for the method.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from fsbench import report  # noqa: E402
from fsbench.dist_env import default_device_type, launch, max_world_size  # noqa: E402
from fsbench.limiter import LimiterConfig, run_limiter  # noqa: E402
from fsbench.memory import MemoryConfig, run_memory  # noqa: E402
from fsbench.timing import Plan  # noqa: E402
from fsbench.trace import TraceConfig, run_trace  # noqa: E402
from fsbench.workloads import CollectivesConfig, TrainConfig, run_collectives, run_training  # noqa: E402

WORKLOADS = ("gpt", "many-small-units", "collectives", "memory", "gpt-bf16")
GPU_WORKLOADS = ("gpt-large", "gpt-large-bf16", "limiter")  # CUDA only: too large for the CPU runs

# Global batches: gpt 8 sequences x 64 tokens; many-small-units 16 samples of 16 features.
FULL = {
    "gpt": TrainConfig("gpt", 8, Plan(warmup=2, rounds=10, steps_per_block=5, drop_per_block=1)),
    "many-small-units": TrainConfig("many-small-units", 16, Plan(warmup=3, rounds=10, steps_per_block=6,
                                                                drop_per_block=1)),
    "collectives": CollectivesConfig((1, 2, 4, 8, 16, 32, 64), Plan(warmup=2, rounds=10, steps_per_block=3,
                                                                    drop_per_block=1)),
    "memory_world_sizes": (1, 2, 4),
    # The gpt workload in bf16 mixed precision (see [Note: bf16 peers] in fsbench/peers.py);
    # fewer steps: bf16 matrix products are ~10x slower than fp32 on CPUs without bf16 units.
    "gpt-bf16": TrainConfig("gpt", 8, Plan(warmup=2, rounds=6, steps_per_block=4, drop_per_block=1),
                            precision="bf16"),
    "bf16_memory_world_sizes": (1, 2),
    # 4 sequences x 1024 tokens, TF32 matrix products (float32 training as run on GPUs).
    "gpt-large": TrainConfig("gpt-large", 4, Plan(warmup=2, rounds=10, steps_per_block=5, drop_per_block=1),
                             tf32=True),
    # The same in bf16 mixed precision (see [Note: bf16 peers] in fsbench/peers.py).
    "gpt-large-bf16": TrainConfig("gpt-large", 4, Plan(warmup=2, rounds=10, steps_per_block=5, drop_per_block=1),
                                  tf32=True, precision="bf16"),
    "limiter": LimiterConfig(),
}
QUICK = {
    "gpt": TrainConfig("gpt", 8, Plan(warmup=1, rounds=2, steps_per_block=3, drop_per_block=1)),
    "many-small-units": TrainConfig("many-small-units", 16, Plan(warmup=1, rounds=2, steps_per_block=3,
                                                                drop_per_block=1)),
    "collectives": CollectivesConfig((1, 4), Plan(warmup=1, rounds=2, steps_per_block=2, drop_per_block=1)),
    "memory_world_sizes": (1, 2),
    "gpt-bf16": TrainConfig("gpt", 8, Plan(warmup=1, rounds=2, steps_per_block=3, drop_per_block=1),
                            precision="bf16"),
    "bf16_memory_world_sizes": (2,),
    "gpt-large": TrainConfig("gpt-large", 4, Plan(warmup=1, rounds=2, steps_per_block=2, drop_per_block=1),
                             tf32=True),
    "gpt-large-bf16": TrainConfig("gpt-large", 4, Plan(warmup=1, rounds=2, steps_per_block=2, drop_per_block=1),
                                  tf32=True, precision="bf16"),
    "limiter": LimiterConfig(steps=2),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: few steps, small sizes; not published")
    p.add_argument("--profile", action="store_true", help="only write a Chrome trace of one flatshard step")
    p.add_argument("--workloads", default=None,
                   help=f"comma-separated subset of {WORKLOADS + GPU_WORKLOADS} (default: all that the device runs; "
                        f"{GPU_WORKLOADS} need CUDA)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--out", default=os.path.join(HERE, "out"), help="output folder (default benchmarks/out)")
    p.add_argument("--no-publish", action="store_true",
                   help="do not update benchmarks/RESULTS.md and benchmarks/results/ (implied by --quick "
                        "and by a subset of --workloads)")
    args = p.parse_args()
    try:
        import matplotlib  # noqa: F401  (plots come last: fail before minutes of measuring)
    except ImportError:
        p.error("matplotlib is needed for the plots: pip install matplotlib "
                "(or run bash scripts/run_benchmarks.sh, which installs what is missing)")
    device = default_device_type() if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False")
    default = WORKLOADS + (GPU_WORKLOADS if device == "cuda" else ())
    selected = [w.strip() for w in (args.workloads or ",".join(default)).split(",") if w.strip()]
    unknown = set(selected) - set(WORKLOADS + GPU_WORKLOADS)
    if unknown:
        p.error(f"--workloads: unknown {sorted(unknown)}; expected a subset of {WORKLOADS + GPU_WORKLOADS}")
    if device != "cuda" and set(selected) & set(GPU_WORKLOADS):
        p.error(f"--workloads: {sorted(set(selected) & set(GPU_WORKLOADS))} run on CUDA only")
    cfg = QUICK if args.quick else FULL
    # CPU: W=2 for timing, W=1 against local training. GPU: NCCL at W=1 (and W=2 given two GPUs).
    timing_world_sizes = (2, 1) if max_world_size(device) >= 2 else (1,)

    if args.profile:
        w = timing_world_sizes[0]
        got = launch([("trace", run_trace, TraceConfig(os.path.join(args.out, "trace"),
                                                       cfg["gpt"].global_batch))], w, device)["trace"]
        if "error" in got:
            print(f"profile failed: {got['error']}", file=sys.stderr)
            return 1
        print(f"wrote {got['trace_rank0']} (one file per rank, W={w}); flatshard ranges in the step:")
        for name, count in got["flatshard_ranges"].items():
            print(f"  {name}: {count}")
        return 0

    start = time.perf_counter()
    results: dict = {"meta": _meta(device, args.quick), "timing": {}, "memory": {}, "memory_bf16": {}}
    for w in timing_world_sizes:
        tasks = [(wl, run_training, cfg[wl]) for wl in ("gpt", "many-small-units", "gpt-bf16") if wl in selected]
        for wl in ("gpt-large", "gpt-large-bf16"):
            if wl in selected and w == 1:
                tasks.append((wl, run_training, cfg[wl]))
        if "collectives" in selected and w == timing_world_sizes[0]:
            tasks.append(("collectives", run_collectives, cfg["collectives"]))
        if not tasks:
            continue
        _say(f"timing at W={w}: {', '.join(t[0] for t in tasks)}")
        got = launch(tasks, w, device)
        coll = got.pop("collectives", None)
        if coll is not None:
            results["collectives"] = coll
        results["timing"][str(w)] = got
        _report_errors(got)
    if "memory" in selected:
        for w in cfg["memory_world_sizes"]:
            if w > max_world_size(device):
                results["memory"][str(w)] = {"skipped": f"needs {w} {device} devices, found {max_world_size(device)}"}
                continue
            _say(f"memory at W={w}")
            results["memory"][str(w)] = launch([("memory", run_memory, MemoryConfig())], w, device)["memory"]
            _report_errors({"memory": results["memory"][str(w)]})
    if "gpt-bf16" in selected:
        for w in cfg["bf16_memory_world_sizes"]:
            if w > max_world_size(device):
                continue
            _say(f"memory in bf16 at W={w}")
            got = launch([("memory", run_memory, MemoryConfig(precision="bf16"))], w, device)["memory"]
            results["memory_bf16"][str(w)] = got
            _report_errors({"memory bf16": got})
    if "limiter" in selected:
        _say("limiter at W=2 on one GPU (gloo)")
        results["limiter"] = launch([("limiter", run_limiter, cfg["limiter"])], 2, device, one_gpu=True)["limiter"]
        _report_errors({"limiter": results["limiter"]})
    results["wall_s"] = time.perf_counter() - start
    # RESULTS.md shows a complete, full run only.
    publish = None if (args.quick or args.no_publish or set(selected) != set(default)) else HERE
    written = report.write(results, args.out, publish)
    print()
    print(report.markdown(results))
    print(f"wrote {written['json']}, {written['table']}, {len(written['plots'])} plots in {args.out}"
          + (f"; updated {written['results_md']}" if "results_md" in written else ""))
    print(f"wall time {results['wall_s']:.0f} s")
    return 0


def _say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _report_errors(got: dict) -> None:
    for name, r in got.items():
        if isinstance(r, dict) and "error" in r:
            _say(f"  {name}: {r['error']}")


def _meta(device: str, quick: bool) -> dict:
    repo = os.path.dirname(HERE)

    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""

    # The GPU machine receives the working tree without a current .git: FLATSHARD_COMMIT names it there.
    commit = os.environ.get("FLATSHARD_COMMIT") or git("rev-parse", "--short", "HEAD") or "unknown"
    if "FLATSHARD_COMMIT" not in os.environ and git("status", "--porcelain", "--", "python", "csrc"):
        commit += " + uncommitted library changes"
    if device == "cuda":
        machine = f"{torch.cuda.device_count()}× {torch.cuda.get_device_name(0)}, NCCL"
    else:
        machine = f"{_cpu_name()}, {os.cpu_count()} cores, gloo, 1 thread per rank"
    import flatshard

    return {
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "commit": commit,
        "machine": machine,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "flatshard": getattr(flatshard, "__version__", "?"),
        "device": device,
        "quick": quick,
        "command": "python benchmarks/run.py" + "".join(f" {shlex.quote(a)}" for a in sys.argv[1:]),
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "CPU"


if __name__ == "__main__":
    sys.exit(main())
