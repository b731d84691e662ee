"""flatshard.plan's memory per rank against the measured peak: the table of benchmarks/RESULTS.md.

Runs tests/scripts/plan_memory_cases.py (the tests' GPT: W = 1, 2, 4 over gloo; rank 3 of W = 8, 64, 1024 under
torch's fake process group) and tests/scripts/plan_memory_lm_cases.py (HF Llama models with a real vocabulary's
proportions: rank 3 of W = 8 and 64 under the fake group) with the malloc counter preloaded and prints one line per
case: planned / measured peak per rank. tests/test_plan_memory.py checks the language models' cases and a subset of the
GPT's (gloo at W = 2; the fake group at W = 1, 8, 1024) with the same tolerances.
Run: python benchmarks/plan_memory.py
"""
import json
import os
import subprocess
import sys

TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
sys.path.insert(0, TESTS)
from _memcount import preloaded_env  # noqa: E402

if __name__ == "__main__":
    for script, args in (("plan_memory_cases.py", ["gloo", "1", "2", "4"]),
                         ("plan_memory_cases.py", ["fake", "8", "64", "1024"]),
                         ("plan_memory_lm_cases.py", ["8", "64"])):
        done = subprocess.run([sys.executable, os.path.join(TESTS, "scripts", script), *args],
                              capture_output=True, text=True, env=preloaded_env(), check=True)
        for line in done.stdout.splitlines():
            if line.startswith("{"):
                c = json.loads(line)
                print(f"{c['case']:<30} rank {c['rank']}  planned {c['planned']:>10}  measured {c['measured']:>10}  "
                      f"ratio {c['planned'] / c['measured']:.3f}", flush=True)
