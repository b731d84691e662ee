"""Two builds of flatshard against each other on one workload, interleaved run by run.

    python benchmarks/compare_builds.py --before /path/to/venv-old/bin/python --before-tree /path/to/old-checkout \\
        --after /path/to/venv-new/bin/python [--workload many-small-units] [--repeats 3]

A change to the hot path is judged by the same workload measured with the build before
and the build after it, on the same machine at the same time: this runs
``benchmarks/run.py --workloads <workload> --no-publish`` with each interpreter in turn
(before, after, before, after, ...), each from its own checkout's benchmarks (the harness
reads the runtime's internals, which a change may move), each run's peers interleaved as run.py does, and
reports per world size each build's median over runs of flatshard's figure (µs per unit
over local for ``many-small-units``, else the median step time) beside torch FSDP2's from
the same runs, which tells how the machine's speed moved. Each interpreter must have its
flatshard installed (e.g. a ``python -m venv --system-site-packages`` per build).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def _figures(results: dict, workload: str) -> dict[str, dict[str, float]]:
    """{world size: {peer: figure}} of one run.json for the flatshard and FSDP2 peers."""
    out: dict[str, dict[str, float]] = {}
    for world_size, runs in results.get("timing", {}).items():
        run = runs.get(workload) or {}
        for peer in ("flatshard", "fsdp2"):
            entry = run.get("peers", {}).get(peer) or {}
            value = (entry.get("overhead_us_per_unit") if workload == "many-small-units"
                     else (entry.get("time") or {}).get("median_ms"))
            if value is not None:
                out.setdefault(world_size, {})[peer] = float(value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="python with the build before the change")
    parser.add_argument("--after", required=True, help="python with the build after the change")
    parser.add_argument("--before-tree", default=os.path.dirname(HERE), help="checkout of the build before")
    parser.add_argument("--after-tree", default=os.path.dirname(HERE), help="checkout of the build after")
    parser.add_argument("--workload", default="many-small-units")
    parser.add_argument("--repeats", type=int, default=3, help="runs per build")
    args = parser.parse_args()
    figures: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for label, python, tree in (("before", args.before, args.before_tree),
                                        ("after", args.after, args.after_tree)):
                out = os.path.join(tmp, f"{label}{i}")
                subprocess.run([python, os.path.join(tree, "benchmarks", "run.py"), "--workloads", args.workload,
                                "--no-publish", "--out", out], check=True, stdout=subprocess.DEVNULL)
                with open(os.path.join(out, "results.json")) as f:
                    figures[label].append(_figures(json.load(f), args.workload))
                print(f"run {i + 1}/{args.repeats} {label}: {figures[label][-1]}", file=sys.stderr, flush=True)
    unit = "µs per unit over local" if args.workload == "many-small-units" else "median step ms"
    print(f"| `{args.workload}` | flatshard before | flatshard after | after / before | FSDP2 (before runs) "
          f"| FSDP2 (after runs) |  ({unit}, median of {args.repeats} runs each, interleaved)")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for world_size in sorted({w for runs in figures.values() for f in runs for w in f}):
        med = {label: {peer: statistics.median(f[world_size][peer] for f in runs if peer in f.get(world_size, {}))
                       for peer in ("flatshard", "fsdp2")} for label, runs in figures.items()}
        print(f"| W={world_size} | {med['before']['flatshard']:.1f} | {med['after']['flatshard']:.1f} | "
              f"{med['after']['flatshard'] / med['before']['flatshard']:.2f}× | {med['before']['fsdp2']:.0f} | "
              f"{med['after']['fsdp2']:.0f} |")


if __name__ == "__main__":
    main()
