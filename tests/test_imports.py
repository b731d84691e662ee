"""What ``import flatshard`` loads: a training process pays for no more than it uses (issue 30, item 6).

A fresh interpreter (the pytest process has imported everything by now).
"""

from __future__ import annotations

import os
import subprocess
import sys


def _fresh_interpreter(*lines: str, **environment: str) -> subprocess.CompletedProcess:
    """``lines`` run in a new interpreter (nothing imported yet), with ``environment`` added; its output."""
    return subprocess.run([sys.executable, "-c", "\n".join(lines)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **environment})


def test_import_flatshard_leaves_the_planner_and_dynamo_until_they_are_used():
    """Neither the planner nor torch._dynamo (seconds of every process's start; see [Note: Lazy dynamo]) is
    imported by ``import flatshard``."""
    done = _fresh_interpreter("import sys, flatshard",
                              "print('torch._dynamo' in sys.modules)",
                              "print(sorted(m for m in sys.modules if m.startswith('flatshard.plan')))",
                              "flatshard.plan.measure_activations",
                              "print(callable(flatshard.plan), 'flatshard.plan._activations' in sys.modules)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["False", "[]", "True True"], done.stdout


def test_import_flatshard_loads_torch_with_the_first_name_used():
    """[Note: A lazy import]: ``import flatshard`` imports neither torch nor the runtime; every public name (torch's
    enums and configs of api.py included, the same list) and submodule resolves on first use; ``from flatshard
    import ...`` works as before; ``import flatshard._C`` first imports torch."""
    done = _fresh_interpreter("import sys, flatshard",
                              "print('torch' in sys.modules)",
                              "from flatshard import FullyShardedDataParallel, fully_shard, MixedPrecision, FSDP",
                              "import flatshard.api as api",
                              "print(FSDP is FullyShardedDataParallel, flatshard._C.__name__, flatshard.wrap.__name__)",
                              "print(sorted(api.__all__) == sorted(n for n in flatshard.__all__ if hasattr(api, n)))",
                              "print(all(getattr(flatshard, n) is not None for n in flatshard.__all__))",
                              "print(hasattr(flatshard, 'no_such_name'))")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["False", "True flatshard._C flatshard.wrap", "True", "True", "False"], \
        done.stdout
    done = _fresh_interpreter("import flatshard._C", "print(flatshard._C.__name__)")
    assert done.stdout.splitlines() == ["flatshard._C"], done.stderr


def test_the_planners_command_line_refuses_before_importing_torch():
    """Issue 34: a bad argument to ``python -m flatshard.plan`` is answered before torch is imported (a fraction of a
    second, where importing torch and its FSDP takes seconds), also with the opt-in in the environment."""
    code = ("import sys", "from flatshard.plan.__main__ import main", "try:",
            "    main(['--world-size', '0', '--hf-config', 'config.json'])", "except SystemExit as stop:",
            "    print(stop.code)", "print('torch' in sys.modules)")
    done = _fresh_interpreter(*code)
    assert done.stdout.splitlines() == ["2", "False"], (done.stdout, done.stderr)
    assert "--world-size: expected a number of ranks >= 1 but got 0" in done.stderr, done.stderr
    done = _fresh_interpreter(*code, FLATSHARD_AS_TORCH_FSDP="1")
    assert done.stdout.splitlines() == ["2", "False"], (done.stdout, done.stderr)


# The runtime layer (DESIGN.md's "Layers"): what either front-end hands modules to. It imports nothing of a
# front-end (the FullyShardedDataParallel class's module, torch's facade), except for type annotations.
RUNTIME = ("_config", "_state", "_construction", "_runtime", "_backward", "_full_params", "_clip_grad_norm",
           "_host_offload", "_state_dict",
           "_sharded_state_dict", "_state_dict_load", "_optim_state_dict", "_mixed_precision", "_orig_params",
           "_comm_hooks", "_rank_guard", "_stall_watch", "_guard_links", "_exit", "_profiling", "_common",
           "_broadcast", "_stale_optimizer", "_dtensor_params", "_wakeup", "_tensor_parallel", "_prefetch")
FRONT_ENDS = ("flatshard.fully_sharded_data_parallel", "flatshard._fsdp1_config", "flatshard._torch_facade",
              "flatshard._fully_shard", "flatshard._fsdp_module", "flatshard._fsdp2_config",
              "flatshard._param_meshes")
# torch's names every layer shares (enums, configs, policies) and the package's entry.
SHARED = ("__init__", "api", "wrap")


def _imports(path):
    """(module imported, line, whether only for type checking, whether inside a function) of a source file."""
    import ast

    tree = ast.parse(open(path).read())
    found = []

    def visit(node, typing_only, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                visit(child, True, in_function)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, typing_only, True)
            elif isinstance(child, ast.ImportFrom) and child.module:  # (from flatshard import _runtime: both)
                found.append((child.module, child.lineno, typing_only, in_function))
                found.extend((f"{child.module}.{a.name}", child.lineno, typing_only, in_function) for a in child.names)
            elif isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, typing_only, in_function) for a in child.names)
            else:
                visit(child, typing_only, in_function)

    visit(tree, False, False)
    return found


def test_the_runtime_imports_no_front_end_and_hides_no_cycle_in_a_function():
    import os

    import flatshard

    package = os.path.dirname(flatshard.__file__)
    layers = set(RUNTIME) | {f.split(".")[1] for f in FRONT_ENDS} | set(SHARED)
    unplaced = sorted(f[:-3] for f in os.listdir(package) if f.endswith(".py") and f[:-3] not in layers)
    assert not unplaced, f"modules in no layer (add each to RUNTIME, FRONT_ENDS or SHARED here): {unplaced}"
    problems = []
    for name in RUNTIME:
        path = os.path.join(package, f"{name}.py")
        for module, line, typing_only, in_function in _imports(path):
            if typing_only or not module.startswith("flatshard"):
                continue
            if module.startswith(FRONT_ENDS):
                problems.append(f"{name}.py:{line} imports {module}, a front-end")
            elif in_function and module.split(".")[1:2] and module.split(".")[1] in RUNTIME:
                problems.append(f"{name}.py:{line} imports {module} inside a function (an import cycle hidden?)")
    assert not problems, "\n".join(problems)


def test_no_function_over_sixty_lines_in_the_runtime_or_a_front_end_module():
    """What one reads in a sitting (issue 30): every function of the runtime layer and of the class's resolver
    fits in 60 lines; the class's own methods are its public API and its docstrings."""
    import ast
    import os

    import flatshard

    package = os.path.dirname(flatshard.__file__)
    long = []
    for name in (*RUNTIME, "_fsdp1_config", "wrap"):
        path = os.path.join(package, f"{name}.py")
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long.append(f"{name}.py:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, "split along its concerns: " + ", ".join(long)
