"""Runs ``python -m flatshard.plan`` several times in one interpreter (tests/test_plan.py).

    python plan_cli_runs.py RUNS.json

RUNS.json maps a name to the CLI's arguments. Each run goes through ``runpy`` exactly as ``-m``
does (``__main__`` of ``flatshard.plan``, ``sys.argv`` set); its stdout, stderr and exit status are
written beside RUNS.json as NAME.out, NAME.err and NAME.rc. The CLI is mostly its imports (torch,
transformers: about ten seconds of one core): one interpreter pays them once for every run.
"""

import contextlib
import io
import json
import os
import runpy
import sys
import traceback


def run(argv):
    out, err = io.StringIO(), io.StringIO()
    sys.argv = ["python -m flatshard.plan", *argv]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module("flatshard.plan", run_name="__main__", alter_sys=True)
            rc = 0
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # noqa: B036 - reported in NAME.err and NAME.rc, as the interpreter would
            traceback.print_exc()
            rc = 1
    return rc, out.getvalue(), err.getvalue()


def main(path):
    where = os.path.dirname(path)
    with open(path) as f:
        runs = json.load(f)
    for name, argv in runs.items():
        rc, out, err = run(argv)
        for suffix, text in (("out", out), ("err", err), ("rc", str(rc))):
            with open(os.path.join(where, f"{name}.{suffix}"), "w") as f:
                f.write(text)


if __name__ == "__main__":
    main(sys.argv[1])
