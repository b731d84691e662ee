"""``flatshard.plan`` (issue 20): planned collective bytes per unit equal what the runtime counts.

Each rank wraps the tests' GPT (and a model whose units need padding) for every strategy
(FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD with shard groups of 2 at W = 4), in fp32
and with bf16 mixed precision, at W = 1, 2, 4 over gloo; runs one training step after
resetting the runtime's counters ([Note: Collective byte counters]); and compares each
unit's counted input bytes per kind with ``flatshard.plan`` of the same model built on the
meta device: equal, byte for byte. The process group's totals (``_C.collective_counts``)
must equal the sum over units. The same under torch's fake process group at W = 8, 64, 1024
(tests/scripts/plan_under_fake_pg.py). ``python -m flatshard.plan`` on Llama-3-8B- and 70B-shaped
configs is checked against totals computed by hand here, and must not build the model (its peak memory).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from flatshard.testing import run_distributed
from models import Block, gpt_loss, local_slice, make_batch, make_gpt

STRATEGIES = [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD,
              ShardingStrategy.HYBRID_SHARD]


class _Odd(nn.Module):
    """Units of 3x2+3 and 3+6 elements: padded at W = 2 and 4."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(2, 3), nn.Tanh())
        self.head = nn.Linear(3, 1, bias=False)
        self.scale = nn.Parameter(torch.ones(6))

    def forward(self, x):
        return (self.head(self.inner(x)) * self.scale.sum()).sum()


def _build(kind, device=None):
    with torch.device(device or "cpu"):
        if kind == "gpt":
            return make_gpt() if device is None else type(make_gpt())(64, 16, 3, 4, 16), ModuleWrapPolicy({Block})
        torch.manual_seed(0)
        return _Odd(), ModuleWrapPolicy({nn.Sequential})


def _loss(kind, model, rank, world_size):
    if kind == "gpt":
        return gpt_loss(model, *local_slice(make_batch(), rank, world_size))
    return model(torch.randn(4, 2, generator=torch.Generator().manual_seed(rank)))


def _counted(rank, world_size):
    import flatshard
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import _C

    os.environ["LOCAL_WORLD_SIZE"] = str(min(2, world_size))  # hybrid: shard groups of 2
    out = []
    for kind in ("gpt", "odd"):
        for strategy in STRATEGIES:
            for mixed in (None, MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)):
                module, policy = _build(kind)
                model = FSDP(module, auto_wrap_policy=policy, sharding_strategy=strategy, mixed_precision=mixed,
                             device_id=torch.device("cpu"))
                _loss(kind, model, rank, world_size).backward()  # lazy init, first iteration
                units = [u for u in FSDP.fsdp_modules(model) if u._unit_state.handle is not None]
                for u in units:
                    u._unit_state.handle.reset_collective_bytes()
                _C.reset_collective_counts()
                _loss(kind, model, rank, world_size).backward()
                counted = {u._unit_state.name: u._unit_state.handle.collective_bytes for u in units}
                groups = _C.collective_counts()
                meta_module, meta_policy = _build(kind, "meta")
                planned = flatshard.plan(meta_module, world_size, auto_wrap_policy=meta_policy,
                                         sharding_strategy=strategy, mixed_precision=mixed,
                                         ranks_per_host=min(2, world_size))
                out.append({"case": f"{kind} {strategy.name} {'bf16' if mixed else 'fp32'}", "counted": counted,
                            "planned": {u.name: t.as_dict() for u, t in zip(planned.units, planned.traffic)},
                            "group_bytes": {kind_: sum(v[kind_][1] for v in groups.values())
                                            for kind_ in ("all_gather", "reduce_scatter", "all_reduce")}})
    out += _counted_fully_shard(rank, world_size)
    return out


def _counted_fully_shard(rank, world_size):
    """The same for ``fully_shard`` on each block (the policy's modules), then the root (see [Note: A fully_shard
    plan] in flatshard/plan/__init__.py): resharding None, True and False, bf16, HSDP at W = 4, frozen weights."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import flatshard
    from flatshard import _C

    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    cases = [("gpt", None, None, False, False), ("gpt", True, bf16, False, False), ("gpt", False, None, False, False),
             ("gpt", None, None, False, True), ("odd", None, None, False, False)]
    if world_size == 4:
        cases.append(("gpt", None, None, True, False))
    out = []
    for kind, reshard, mixed, hybrid, frozen in cases:
        plans = []
        for device in (None, "meta"):
            module, policy = _build(kind, device)
            if frozen:  # (LoRA's shape: the projections frozen; only the trainable rows are reduce-scattered)
                for block in module.blocks:
                    block.attn.qkv.weight.requires_grad_(False)
            plans.append((module, policy))
        (module, policy), (meta_module, meta_policy) = plans
        mesh = (init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if hybrid
                else init_device_mesh("cpu", (world_size,)))
        kwargs = dict(mesh=mesh, reshard_after_forward=reshard, mp_policy=mixed or MixedPrecisionPolicy())
        targets = [m for m in module.modules() if m is not module and isinstance(m, tuple(policy._module_classes))]
        for target in reversed(targets):
            flatshard.fully_shard(target, **kwargs)
        flatshard.fully_shard(module, **kwargs)
        _loss(kind, module, rank, world_size).backward()  # lazy init, first iteration
        names = {m: name for name, m in module.named_modules()}
        units = [m for m in [module, *targets] if m._unit_state.handle is not None]
        for u in units:
            u._unit_state.handle.reset_collective_bytes()
        _loss(kind, module, rank, world_size).backward()
        counted = {names[u]: u._unit_state.handle.collective_bytes for u in units}
        planned = flatshard.plan(meta_module, world_size, api="fully_shard", auto_wrap_policy=meta_policy,
                                 reshard_after_forward=reshard, mixed_precision=mixed, ranks_per_host=2,
                                 sharding_strategy=ShardingStrategy.HYBRID_SHARD if hybrid else None)
        out.append({"case": f"fully_shard {kind} reshard={reshard} {'bf16' if mixed else 'fp32'}"
                            f"{' hsdp' if hybrid else ''}{' frozen' if frozen else ''}", "counted": counted,
                    "planned": {u.name: t.as_dict() for u, t in zip(planned.units, planned.traffic)}})
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_planned_collective_bytes_equal_counted_bytes(world_size):
    for rank, cases in enumerate(run_distributed(_counted, world_size, timeout=240)):
        for case in cases:
            where = f"rank {rank}, W={world_size}, {case['case']}"
            assert case["planned"] == case["counted"], f"{where}: planned {case['planned']} vs counted {case['counted']}"
            if "group_bytes" not in case:  # (fully_shard's: the meshes' groups are counted apart)
                continue
            totals = {k: sum(b[k] for b in case["counted"].values()) for k in ("all_gather", "reduce_scatter")}
            totals["all_reduce"] = sum(b["all_reduce"] + b["replica_all_reduce"] for b in case["counted"].values())
            assert totals == case["group_bytes"], f"{where}: per unit {totals} vs per group {case['group_bytes']}"


def _llama_config(tmp_path, name, vocab, hidden, intermediate, layers, heads, kv_heads):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "max_position_embeddings": 8192, "tie_word_embeddings": False}))
    return str(path)


MAX_PLANNER_RSS = 3 << 29  # 1.5 GiB

LLAMAS = {  # name: (vocab, hidden, intermediate, layers, heads, kv_heads)
    "llama3_8b": (128256, 4096, 14336, 32, 32, 8),
    "llama3_70b": (128256, 8192, 28672, 80, 64, 8),
}


FAKE_PG_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "plan_under_fake_pg.py")
CLI_RUNS_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "plan_cli_runs.py")
SMALL_LLAMA = ("small", 1000, 128, 256, 4, 4, 2)


@dataclasses.dataclass
class _Child:
    process: subprocess.Popen
    where: object  # the run's directory (a pathlib.Path)
    usage: object = None  # its resource usage once it ended (os.wait4's, its own peak memory)

    def wait(self, timeout):
        """Waits for the child (at most ``timeout`` s: a hang's bound), once."""
        if self.usage is None:
            deadline = time.monotonic() + timeout
            while True:
                pid, status, usage = os.wait4(self.process.pid, os.WNOHANG)
                if pid:
                    self.process.returncode = os.waitstatus_to_exitcode(status)
                    self.usage = usage
                    break
                if time.monotonic() > deadline:
                    self.process.kill()
                    raise AssertionError(f"{self.process.args} did not end within {timeout} s")
                time.sleep(0.05)
        err = (self.where / "stderr").read_text()
        assert self.process.returncode == 0, err[-4000:]
        return self


@pytest.fixture(scope="module", autouse=True)
def separate_runs(tmp_path_factory):
    """The module's runs of an interpreter of their own, started together at the module's first test (they go on
    beside the tests that run in this process or at W = 1, which leave a core free): the CLI on
    each Llama's shapes, with --plot, and on a small Llama with and without a batch (one interpreter for all,
    tests/scripts/plan_cli_runs.py: the CLI is mostly its imports); the fake process group's script.
    {"cli": _Child, "fake_pg": _Child}; a test waits for the one it reads."""
    children = {}

    def start(name, argv):
        where = tmp_path_factory.mktemp(name)
        with open(where / "stdout", "w") as o, open(where / "stderr", "w") as e:
            children[name] = _Child(subprocess.Popen(argv(where), stdout=o, stderr=e), where)

    def cli_runs(where):
        runs = {"plot": ["--hf-config", _llama_config(where, "plot", 1000, 256, 512, 4, 8, 4), "--world-size", "16",
                         "--plot", str(where / "plan.png")]}
        if importlib.util.find_spec("transformers") is not None:
            runs.update({name: ["--hf-config", _llama_config(where, name, *shape), "--world-size", "64",
                                "--mixed-precision", "bf16", "--json"] for name, shape in LLAMAS.items()})
            runs["llama3_8b_fully_shard"] = ["--hf-config", _llama_config(where, "fs", *LLAMAS["llama3_8b"]),
                                             "--world-size", "48", "--mixed-precision", "bf16", "--json",
                                             "--api", "fully_shard"]
            small = ["--hf-config", _llama_config(where, *SMALL_LLAMA), "--world-size", "8"]
            runs.update(measured=[*small, "--batch-size", "2", "--seq-len", "64", "--json"], unmeasured=small)
            config = small[1]
            runs.update({f"bad_{name}": argv for name, argv in BAD_CLI_INPUTS(config).items()})
        (where / "runs.json").write_text(json.dumps(runs))
        return [sys.executable, CLI_RUNS_SCRIPT, str(where / "runs.json")]

    start("cli", cli_runs)
    start("fake_pg", lambda where: [sys.executable, FAKE_PG_SCRIPT, "8", "64", "1024"])
    yield children
    for child in children.values():
        if child.process.returncode is None and child.process.poll() is None:
            child.process.kill()
            child.process.wait()


def BAD_CLI_INPUTS(config: str) -> dict[str, list[str]]:  # noqa: N802 - a table, built with the run's config
    """Bad command lines (issue 34) and, per name, what the one line of the answer must name."""
    return {
        "world_size_0": ["--hf-config", config, "--world-size", "0"],
        "world_size_negative": ["--hf-config", config, "--world-size", "-8"],
        "hybrid_not_a_multiple": ["--hf-config", config, "--world-size", "12", "--strategy", "HYBRID_SHARD"],
        "config_missing": ["--hf-config", config + ".missing", "--world-size", "8"],
        "strategy_unknown": ["--hf-config", config, "--world-size", "8", "--strategy", "ZERO3"],
        "batch_without_seq_len": ["--hf-config", config, "--world-size", "8", "--batch-size", "2"],
    }


BAD_CLI_ANSWERS = {"world_size_0": "--world-size: expected a number of ranks >= 1 but got 0",
                   "world_size_negative": "--world-size: expected a number of ranks >= 1 but got -8",
                   "hybrid_not_a_multiple": "--world-size 12 is not a multiple of --ranks-per-host 8",
                   "config_missing": "--hf-config: no file at",
                   "strategy_unknown": "--strategy: expected one of FULL_SHARD",
                   "batch_without_seq_len": "--batch-size and --seq-len go together"}


@pytest.mark.parametrize("name", list(BAD_CLI_ANSWERS))
def test_cli_answers_a_bad_input_in_one_line(name, separate_runs):
    """Issue 34: each bad input is refused before anything is built: exit status 2, one line naming the input and
    the fix, no traceback."""
    pytest.importorskip("transformers")
    where = separate_runs["cli"].wait(600).where
    rc, out, err = ((where / f"bad_{name}.{suffix}").read_text() for suffix in ("rc", "out", "err"))
    assert rc == "2" and not out, (rc, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and BAD_CLI_ANSWERS[name] in lines[0] and "Traceback" not in err, err


def _cli(separate_runs, name):
    """The CLI run ``name``'s stdout; asserts it exited 0."""
    where = separate_runs["cli"].wait(600).where
    rc, out, err = ((where / f"{name}.{suffix}").read_text() for suffix in ("rc", "out", "err"))
    assert rc == "0", f"python -m flatshard.plan ({name}) exited {rc}:\n{err[-4000:]}"
    return out


@pytest.mark.parametrize("name", list(LLAMAS))
def test_cli_on_llama_shapes_matches_hand_computed_totals(name, separate_runs):
    pytest.importorskip("transformers")
    vocab, hidden, inter, layers, heads, kv = LLAMAS[name]
    world = 64
    got = json.loads(_cli(separate_runs, name))
    # The model is never built for real (meta device): in fp32 either needs 32 GB or more (the interpreter that runs
    # every CLI case, imports included, peaks near 0.5 GB on a CPU build of torch).
    peak = separate_runs["cli"].usage.ru_maxrss * 1024
    assert peak < MAX_PLANNER_RSS, f"python -m flatshard.plan peaked at {peak / 2**20:.0f} MiB: built for real?"
    # By hand: a decoder layer is q, k, v, o, the MLP's three projections and two norms; the root holds the
    # embedding, the head and the final norm.
    kv_dim = hidden // heads * kv
    layer = hidden * hidden * 2 + hidden * kv_dim * 2 + 3 * hidden * inter + 2 * hidden
    root = 2 * vocab * hidden + hidden
    assert got["parameters"] == layers * layer + root
    assert name != "llama3_8b" or got["parameters"] == 8_030_261_248
    assert name != "llama3_70b" or got["parameters"] == 70_553_706_496
    padded = lambda n: -(-n // world) * world  # noqa: E731
    shard = layers * padded(layer) // world + padded(root) // world
    memory = got["memory_per_rank"]
    assert memory["sharded_params"] == shard * 4
    assert memory["optimizer_state"] == 2 * shard * 4  # AdamW: two fp32 tensors the shard's size
    step = got["step_collective_bytes"]
    # bf16 all-gathers: each layer twice (forward, backward), the root once; bf16 reduce-scatters of the padded units.
    assert step["all_gather"] == 2 * (layers * 2 * padded(layer) // world + padded(root) // world)
    assert step["reduce_scatter"] == 2 * (layers * padded(layer) + padded(root))


def test_cli_fully_shard_plan_on_llama3_8b_matches_hand_computed_totals(separate_runs):
    """``--api fully_shard`` at W = 48, where no projection's rows divide by the world size: each parameter is padded
    to whole rows per rank (FSDP2's dim-0 layout), not the unit as a whole."""
    pytest.importorskip("transformers")
    vocab, hidden, inter, layers, heads, kv = LLAMAS["llama3_8b"]
    world = 48
    got = json.loads(_cli(separate_runs, "llama3_8b_fully_shard"))
    rows = lambda d0, row: -(-d0 // world) * row  # noqa: E731 - one rank's rows of a (d0, row) parameter
    kv_dim = hidden // heads * kv
    layer = (2 * rows(hidden, hidden) + 2 * rows(kv_dim, hidden) + 2 * rows(inter, hidden) + rows(hidden, inter)
             + 2 * rows(hidden, 1))
    root = 2 * rows(vocab, hidden) + rows(hidden, 1)
    assert got["memory_per_rank"]["sharded_params"] == (layers * layer + root) * 4
    step = got["step_collective_bytes"]
    assert step["all_gather"] == 2 * (layers * 2 * layer + root)  # bf16; each layer twice, the root once
    assert step["reduce_scatter"] == 2 * world * (layers * layer + root)
    flat = lambda n: -(-n // world)  # noqa: E731 - the class's shard of a unit of n elements, for contrast
    layer_numel = hidden * hidden * 2 + hidden * kv_dim * 2 + 3 * hidden * inter + 2 * hidden
    assert layers * layer > layers * flat(layer_numel)  # (the per-parameter padding is what differs)


def test_planned_bytes_equal_counted_bytes_under_the_fake_process_group(separate_runs):
    """One process as rank 3 of W = 8, 64, 1024 (torch's fake process group; the rank guard and the exit drain
    run as they do for real, see [Note: The guard under a fake process group]); hybrid with shard groups of 8."""
    stdout = (separate_runs["fake_pg"].wait(600).where / "stdout").read_text()
    cases = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    assert len(cases) == 3 * 4 * 2, stdout[-2000:]
    for case in cases:
        assert case["counted"] and case["planned"] == case["counted"], (
            f"{case['case']}: planned {case['planned']} vs counted {case['counted']}")


def test_cli_plot(separate_runs):
    """``--plot`` writes the figure (memory per rank against world size, bytes per unit)."""
    _cli(separate_runs, "plot")
    path = separate_runs["cli"].where / "plan.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_measured_activations_extrapolate_from_one_and_two_layers(tmp_path, separate_runs):
    """The CLI's activation term (``--batch-size``/``--seq-len``: one- and two-layer models measured, extrapolated
    per layer) equals ``measure_activations`` of the whole four-layer model; the table shows it."""
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM

    from flatshard.plan import measure_activations

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(_llama_config(tmp_path, *SMALL_LLAMA)))
    tokens = torch.randint(0, 1000, (2, 64))
    direct = measure_activations(model, lambda m: m(input_ids=tokens, labels=tokens).loss)
    assert json.loads(_cli(separate_runs, "measured"))["memory_per_rank"]["activations"] == direct
    # Without a batch the term is left out, and the table says so.
    out = _cli(separate_runs, "unmeasured")
    assert "activations                not measured" in out, out


def test_measure_activations_errors():
    from flatshard.plan import measure_activations

    with pytest.raises(TypeError, match=r"model: expected an nn.Module but got Tensor"):
        measure_activations(torch.zeros(2), lambda m: m.sum())
    with pytest.raises(TypeError, match=r"loss_fn\(model\) must return the loss, a tensor of one element, but "
                                        r"returned tuple"):
        measure_activations(nn.Linear(2, 2), lambda m: (m(torch.ones(1, 2)).sum(),))
    # The gradients are not counted: a model whose gradients dwarf its activations measures only the activations.
    big = nn.Linear(1000, 1000)
    assert measure_activations(big, lambda m: m(torch.ones(1, 1000)).sum()) < 64_000


def test_activation_profile_follows_the_backward():
    """[Note: Activations unit by unit]: the profile's peak is ``measure_activations``'; every trainable parameter's
    gradient is marked, in backward order (the last block's before the first's); what a block leaves when its last
    gradient is made shrinks block by block; and the plan held where the step holds (under the fake group's
    W = 64, where activations are most of a rank's peak) is below the plan holding the whole term at every block."""
    from flatshard.plan import ActivationProfile, measure_activations, profile_activations
    import flatshard

    batch = make_batch(batch=8, seq=8, vocab=64, seed=1)
    profile = profile_activations(make_gpt(), lambda m: gpt_loss(m, *batch))
    assert isinstance(profile, ActivationProfile)
    assert profile.peak == measure_activations(make_gpt(), lambda m: gpt_loss(m, *batch)) > 0
    names = [n for n, p in make_gpt().named_parameters() if p.requires_grad]
    assert sorted(profile.grad_order) == sorted(names) and len(profile.segments) == len(names) + 1
    assert profile.grad_order.index("blocks.1.attn.qkv.weight") < profile.grad_order.index("blocks.0.attn.qkv.weight")
    assert 0 < profile.forward <= profile.peak and profile.host_scale >= 1.0
    blocks = [[n for n in names if n.startswith(f"blocks.{i}.")] for i in range(2)]
    acts = profile.at_units(blocks)
    assert acts.left[0] < acts.left[1] < acts.starting[1]
    # where each module's backward began: the root's first (its output is the logits), the last block's before the
    # first's, each before its own first gradient's mark
    began = {name: (segment, piece) for name, segment, piece in profile.pre_backward}
    assert began[""] <= began["blocks.1"] < began["blocks.0"], began
    assert began["blocks.0"][0] <= profile.grad_order.index(blocks[0][-1]), began
    with torch.device("meta"):
        meta = make_gpt()
    kwargs = dict(auto_wrap_policy=ModuleWrapPolicy({Block}), backend="fake", device="cuda")
    held = flatshard.plan(meta, 64, activation_bytes=profile, **kwargs).memory
    whole = flatshard.plan(meta, 64, activation_bytes=profile.peak, **kwargs).memory
    assert held.activations == whole.activations == profile.peak
    assert held.device_peak < whole.device_peak, (held, whole)


def test_activation_profile_maps_onto_units_in_any_order():
    """``ActivationProfile.at_units`` by hand ([Note: A unit's backward in the profile]): a unit's backward spans from
    its first gradient to its last in backward order; what comes before it since the last unit's is the root's (a gap:
    the head's gradient there, the root's, counted from when it is made); a unit whose gradients all came before the
    units after it (an embedding made last but listed after the blocks) holds none of its own there and shifts no other
    unit's window; names the profile never saw are an error."""
    from flatshard.plan import ActivationProfile

    # backward order: head (root's), b1.w, b1.b, b0.w, emb; segments between the gradients
    profile = ActivationProfile(peak=100, forward=90, grad_order=("head", "b1.w", "b1.b", "b0.w", "emb"),
                                grad_bytes=(1, 2, 3, 4, 5), segments=(95, 80, 70, 60, 40, 20),
                                at_grads=(85, 75, 65, 45, 10), backward_start=88)
    acts = profile.at_units([["b0.w"], ["b1.w", "b1.b"]], root_params=["head", "emb"])
    # Without allocations a gradient is made at its mark, a unit's backward begins there: the gap before b1 is segment
    # 0 (the head's gradient made at its end) and the start of segment 1; b1 holds the rest of 1 and segment 2; the
    # gap before b0 the start of segment 3, b0 the rest; then the root's own ("emb")
    assert acts.gaps == [(1, 60), (1, 95)] and acts.root_at_start == [1, 1] and acts.root_at_end == [1, 1]
    assert acts.starting == [60, 80] and acts.left == [45, 65] and acts.after == 40
    assert acts.computing == [(4, 60), (2, 80)]
    # Without the root's names its gradients are not counted here (the plan then counts them whole).
    assert profile.at_units([["b0.w"], ["b1.w", "b1.b"]]).gaps == [(0, 60), (0, 95)]
    # A unit listed after the blocks whose gradient is made last ("emb"): its window begins after the blocks', which
    # hold none of their own (no index past the end, no shifted windows).
    acts = profile.at_units([["b0.w"], ["b1.w", "b1.b"], ["emb"]])
    assert acts.computing[2] == (5, 40) and acts.left[2] == 10 and acts.left[:2] == [20, 20] and acts.after == 20
    with pytest.raises(ValueError, match=r"no gradient of the unit holding '_orig_mod.b0.w'"):
        profile.at_units([["_orig_mod.b0.w"]])


def test_activation_profile_begins_a_units_backward_at_its_pre_backward():
    """A unit's backward begins where the gradient of its output comes in (its pre-backward, marked by the profile),
    not at its first gradient: a head of its own is gathered after the loss's backward, not during it; with FULL_SHARD
    the first unit in backward is gathered from the root's pre-backward (the start of backward when the model computes
    the loss)."""
    from flatshard.plan import ActivationProfile

    # backward order: head.w, b0.w, emb; the loss's backward (50) before the head's pre-backward, in segment 0
    steps = (((-1, 50, 0), (-1, 30, 0), (0, 31, 0)), ((-1, 20, 0), (1, 21, 0)), ((-1, 10, 0), (2, 10, 0)),
             ((-1, 5, 0),))
    base = dict(peak=50, forward=40, grad_order=("head.w", "b0.w", "emb"), grad_bytes=(8, 4, 2),
                segments=(50, 21, 10, 5), at_grads=(31, 21, 10), backward_start=40, segment_steps=steps)
    units, names = [["b0.w"], ["head.w"]], ["b0", "head"]
    loss_outside = ActivationProfile(**base, pre_backward=(("", 0, 1), ("head", 0, 1), ("b0", 1, 0)))
    acts = loss_outside.at_units(units, root_params=["emb"], unit_names=names)
    assert acts.gaps_ungathered[1] == (0, 50) and acts.gaps[1] == (0, 0)  # the loss's backward: the head not gathered
    assert acts.starting[1] == 30 and acts.computing[1] == (8, 31)
    loss_inside = ActivationProfile(**base, pre_backward=(("", 0, 0), ("head", 0, 1), ("b0", 1, 0)))
    acts = loss_inside.at_units(units, root_params=["emb"], unit_names=names)
    assert acts.gaps_ungathered[1] == (0, 0) and acts.gaps[1] == (0, 50)  # gathered from the root's pre-backward
    # Without the marks: from the first gradient's allocation (the loss's backward a gap, the head gathered in it).
    acts = ActivationProfile(**base).at_units(units, root_params=["emb"], unit_names=names)
    assert acts.gaps[1] == (0, 50) and acts.computing[1] == (8, 31)


def test_activation_profile_counts_a_kernels_own_memory_on_a_cpu():
    """[Note: Kernel scratch on a CPU]: a kernel that works in 4 MB of ``malloc``'d memory the profiler never sees
    (an op of the test's, as a bf16 matrix product on a CPU without AVX512-BF16 is of torch's) is in the profile's
    peak, at its call; the same op without the scratch adds nothing."""
    import ctypes

    from flatshard.plan import profile_activations

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    scratch = {"bytes": 0}

    @torch.library.custom_op("flatshard_test::doubled_with_scratch", mutates_args=())
    def doubled_with_scratch(x: torch.Tensor) -> torch.Tensor:
        n = scratch["bytes"]
        if n:
            ptr = libc.malloc(ctypes.c_size_t(n))
            ctypes.memset(ptr, 1, n)
            libc.free(ctypes.c_void_p(ptr))
        return x * 2

    doubled_with_scratch.register_autograd(lambda ctx, grad: grad * 2)
    lin = torch.nn.Linear(64, 64)
    without = profile_activations(lin, lambda m: doubled_with_scratch(m(torch.ones(16, 64))).sum())
    scratch["bytes"] = 4 << 20  # (another batch: a call is measured once per process)
    withit = profile_activations(lin, lambda m: doubled_with_scratch(m(torch.ones(17, 64))).sum())
    assert 0.95 * (4 << 20) <= withit.peak - without.peak <= 1.05 * (4 << 20), (withit.peak, without.peak)
    assert withit.forward - without.forward == withit.peak - without.peak
    # where the CPU stands in for a GPU (the CLI's measure), no CPU kernel's scratch
    stand_in = profile_activations(lin, lambda m: doubled_with_scratch(m(torch.ones(18, 64))).sum(),
                                   kernel_scratch=False)
    assert stand_in.peak - without.peak < 0.05 * (4 << 20), (stand_in.peak, without.peak)


def test_step_time_model():
    """[Note: The timing model]: ring costs by hand for the tests' GPT; overlapping hides communication, never
    more than all of it; a free network costs nothing."""
    import flatshard
    from flatshard.plan import NVLINK, Network

    meta, policy = _build("gpt", "meta")
    compute = (0.010, 0.020, 0.005)
    net = Network("test", bandwidth=1e9, latency=1e-5, step_latency=2e-6)
    serial = flatshard.plan(meta, 4, auto_wrap_policy=policy, network=net, compute=compute, overlap=False)
    t = serial.timing
    # By hand: every unit's all-gathers (the root once, blocks twice) and reduce-scatters; the guard's two exchanges.
    w, expected = 4, {}
    for u in serial.units:
        shard, padded = u.layout.shard_numel * 4, u.layout.padded_numel * 4
        gathers = 1 if u.is_root else 2
        expected["all_gather"] = expected.get("all_gather", 0) + gathers * (1e-5 + 3 * 2e-6 + 3 * shard / 1e9)
        expected["reduce_scatter"] = expected.get("reduce_scatter", 0) + 1e-5 + 3 * 2e-6 + 0.75 * padded / 1e9
    # The guard: two exchanges of log2(4) = 2 rounds, each a two-rank swap of 128 bytes.
    expected["rank_guard"] = 2 * 2 * (1e-5 + 2e-6 + 128 / 1e9)
    assert t.per_kind == pytest.approx(expected)
    from flatshard.plan._timing import _guard_rounds
    assert [_guard_rounds(w) for w in (1, 2, 3, 4, 6, 8, 1024)] == [0, 1, 3, 2, 4, 3, 10]
    # The optimizer steps the rank's shards: a quarter of the elements (and the padding).
    stepped = sum(u.layout.shard_numel for u in serial.units) / sum(u.numel for u in serial.units)
    assert 0.25 <= stepped < 0.26
    assert t.step == pytest.approx(compute[0] + compute[1] + compute[2] * stepped + sum(expected.values()))
    # A loopback network on the compute's cores pays every collective's bytes once more, not its latencies.
    import dataclasses
    loopback = flatshard.plan(meta, 4, auto_wrap_policy=policy, compute=compute, overlap=False,
                              network=dataclasses.replace(net, transfer_on_compute_cores=True)).timing
    transfer = sum(v for k, v in expected.items() if k != "rank_guard") - (1e-5 + 3 * 2e-6) * 2 * len(serial.units) \
        - (1e-5 + 3 * 2e-6) * (len(serial.units) - 1)
    assert loopback.per_kind["transfer_on_compute_cores"] == pytest.approx(transfer)
    assert loopback.step == pytest.approx(t.step + transfer)
    overlapped = flatshard.plan(meta, 4, auto_wrap_policy=policy, network=net, compute=compute, overlap=True).timing
    assert overlapped.compute == t.compute <= overlapped.step < t.step
    assert 0 < overlapped.exposed_communication < t.exposed_communication
    free = Network("free", bandwidth=1e30)
    assert flatshard.plan(meta, 4, auto_wrap_policy=policy, network=free, compute=compute).timing.step == \
        pytest.approx(t.compute)
    # Without compute the step is the communication alone; named networks; bad input names what is wrong.
    alone = flatshard.plan(meta, 64, auto_wrap_policy=policy, network="nvlink").timing
    assert alone.network == NVLINK.name and alone.step >= alone.communication * 0.999 and alone.compute == 0
    with pytest.raises(ValueError, match=r"network: expected one of \['infiniband', 'nvlink'\] or a Network"):
        flatshard.plan(meta, 4, auto_wrap_policy=policy, network="ethernet")
    with pytest.raises(ValueError, match=r"expected a positive bandwidth"):
        Network("bad", bandwidth=0)


def test_fully_shard_plan_refuses_what_it_does_not_model():
    from torch.distributed.fsdp import MixedPrecision as TorchFSDP1MixedPrecision

    import flatshard

    model, policy = _build("gpt", "meta")
    with pytest.raises(NotImplementedError, match=r"reshard_after_forward=2: an int is not planned yet"):
        flatshard.plan(model, 4, api="fully_shard", auto_wrap_policy=policy, reshard_after_forward=2)
    with pytest.raises(ValueError, match=r"reshard_after_forward is fully_shard's argument \(api='fully_shard'\)"):
        flatshard.plan(model, 4, auto_wrap_policy=policy, reshard_after_forward=False)
    with pytest.raises(ValueError, match=r"takes sharding_strategy None, FULL_SHARD .* but got SHARD_GRAD_OP"):
        flatshard.plan(model, 4, api="fully_shard", sharding_strategy=ShardingStrategy.SHARD_GRAD_OP)
    with pytest.raises(TypeError, match=r"takes mixed_precision as torch's MixedPrecisionPolicy but got MixedPrecision"):
        flatshard.plan(model, 4, api="fully_shard", mixed_precision=TorchFSDP1MixedPrecision(torch.bfloat16))
    with pytest.raises(ValueError, match=r"api: expected 'class' or 'fully_shard' but got 'fsdp2'"):
        flatshard.plan(model, 4, api="fsdp2")
