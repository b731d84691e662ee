"""``flatshard.plan``'s memory per rank against the measured peak (issue 20).

tests/scripts/plan_memory_cases.py runs, with the malloc counter preloaded ([Note: Measuring
memory on a CPU] in tests/_memcount.py), the tests' GPT for FULL_SHARD, SHARD_GRAD_OP,
NO_SHARD and HYBRID_SHARD, each plain, with ``no_sync``, bf16 mixed precision and CPU offload,
at W = 2 over gloo (real ranks, gloo's threads beside the compute) and under torch's fake process
group as the one rank of W = 1 and rank 3 of W = 8 and 1024 (hybrid with shard groups of 8: one
replica at W = 8, real replicas at W = 1024); benchmarks/plan_memory.py measures the rest for
benchmarks/RESULTS.md (gloo at W = 1, 2 and 4, a 2x2 hybrid mesh; the fake group at W = 8, 64,
1024), 112 cases more on two cores, left out of the test command;
the activation term comes from ``flatshard.plan.profile_activations`` on the rank's batch.

Tolerances (the planned peak over the measured one; benchmarks/RESULTS.md has the table): the
plan's timeline is a worst-case schedule (a unit's reduction in flight during the next unit's
backward, the prefetched unit's gloo copy still running while a bf16 weight gradient's kernel
holds its float32 scratch), and on two cores the same case's peak moves by 2-7% from step to
step and from rank to rank with how gloo's threads overlap the compute (W = 4 HYBRID_SHARD
bf16: 7.9 to 8.5 MB over the ranks of one run; W = 2 HYBRID_SHARD bf16 under a concurrent load,
2026-11-29: 0.999 of the measured peak on rank 0, 0.929 on rank 1). Every case must be within
-8%/+10%, 19 of 20 within 5%, and the median within 2%; the fake group's cases (no threads) all within 5%: a
missing or doubled term (a unit's buffer, the flat gradient beside the unsharded parameters)
breaks the first for the cases it touches.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

from _memcount import preloaded_env

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "plan_memory_cases.py")
LM_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "plan_memory_lm_cases.py")


def _start(*args, script=SCRIPT):
    return subprocess.Popen([sys.executable, script, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=preloaded_env())


def _cases(proc):
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-4000:]
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


# A hang's bound, not a speed claim: about a minute on two idle cores, over 300 s (pytest's default here) on a busy one.
@pytest.mark.timeout(1800)
def test_planned_peak_memory_is_the_measured_peak():
    # The fake group's cases (one process, no threads) go on beside the gloo ranks': each process's peak is its
    # own (the counter is per process).
    fake_run = _start("fake", "1", "8", "1024")
    gloo, fake = _cases(_start("gloo", "2")), _cases(fake_run)
    assert len(gloo) == 16 * 2 and len(fake) == 16 * 3, (len(gloo), len(fake))
    ratios = {f"{c['case']} rank {c['rank']}": c["planned"] / c["measured"] for c in gloo + fake}
    table = "\n".join(f"{name}: {ratio:.3f}" for name, ratio in ratios.items())
    outside = {name: round(r, 3) for name, r in ratios.items() if not 0.92 <= r <= 1.10}
    assert not outside, f"planned / measured peak outside [0.92, 1.10]: {outside}\n{table}"
    within = sum(abs(r - 1) <= 0.05 for r in ratios.values())
    assert within >= 0.95 * len(ratios), f"only {within} of {len(ratios)} cases within 5%\n{table}"
    assert abs(statistics.median(ratios.values()) - 1) <= 0.02, table
    # The activation term is measured, not left out; the fake group's cases (no thread timing) are all within 5%.
    assert all(abs(c["planned"] / c["measured"] - 1) <= 0.05 for c in fake), table
    for c in gloo + fake:
        assert c["activations"] > 0 and c["plan"]["activations"] == c["activations"], c["case"]


@pytest.mark.timeout(1800)
def test_planned_peak_memory_on_language_models():
    """Issue 34: HF Llama models whose vocabulary outweighs their width (what sets a real LM's peak), shaped as users
    plan them (tests/scripts/plan_memory_lm_cases.py: the embedding and head in the root, tied or not, or units of
    their own; the head registered before the layers; the loss inside the model or outside), FULL_SHARD,
    SHARD_GRAD_OP and NO_SHARD, fp32 and bf16, as rank 3 of W = 8 and 64 under the fake process group: every case
    within 5% of the measured peak (registration order and the root's gradients counted from the start of backward
    planned up to 1.33x; see [Note: A unit's backward in the profile])."""
    cases = _cases(_start("8", "64", script=LM_SCRIPT))
    assert len(cases) == 4 * 3 * 2 * 2, len(cases)
    ratios = {f"{c['case']}": c["planned"] / c["measured"] for c in cases}
    table = "\n".join(f"{name}: {ratio:.3f}" for name, ratio in ratios.items())
    outside = {name: round(r, 3) for name, r in ratios.items() if abs(r - 1) > 0.05}
    assert not outside, f"planned / measured peak outside 5%: {outside}\n{table}"
    for c in cases:
        assert c["activations"] > 0 and c["plan"]["activations"] == c["activations"], c["case"]
