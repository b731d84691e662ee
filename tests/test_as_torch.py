"""The opt-in that makes torch's FSDP1 class flatshard's (issue 19; [Note: flatshard as torch's FSDP]).

- ``FLATSHARD_AS_TORCH_FSDP=1`` installs it at interpreter start (a fresh interpreter, as a
  ``torchrun`` worker is), whatever the import order: names bound to torch's class and to
  torch's ``torch.distributed.checkpoint.state_dict`` helpers before flatshard was imported
  reach flatshard; without the variable nothing of torch's changes.
- ``install_as_torch_fsdp()`` late rebinds names already imported, and ``uninstall`` puts
  back every attribute of torch's class and module as it was.
- torch's own ``get_state_dict`` / ``set_state_dict`` + DCP under the opt-in at W = 2: the
  read-back of every entry equals what was saved, and the resumed run trains as the
  uninterrupted one, bit for bit.
- torch internals flatshard does not have fail with an error that names them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from flatshard.testing import run_distributed
from models import Block, make_gpt, train_gpt

STEPS, SAVE_AT = 5, 3


def _pythons(*runs: tuple[str, bool]) -> list[str]:
    """Each ``(code, opt_in)`` in a fresh interpreter, all at once (each is mostly its imports, on one core);
    their outputs."""
    procs = []
    for code, opt_in in runs:
        env = {k: v for k, v in os.environ.items() if k != "FLATSHARD_AS_TORCH_FSDP"}
        if opt_in:
            env["FLATSHARD_AS_TORCH_FSDP"] = "1"
        procs.append(subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        outs.append(out.strip())
    return outs


def _python(code: str, opt_in: bool) -> str:
    return _pythons((code, opt_in))[0]


_PROBE = """
    from torch.distributed.checkpoint.state_dict import get_state_dict   # bound before flatshard is imported
    from torch.distributed._composable.fsdp import fully_shard as composable_fully_shard  # (transformers' path)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    import torch.distributed.fsdp as torch_fsdp
    import torch.distributed.fsdp._runtime_utils as runtime_utils
    import flatshard, flatshard.checkpoint, flatshard._torch_facade.opt_in as as_torch
    print(flatshard.is_active(), getattr(FSDP, "_is_flatshard_unit", False),
          get_state_dict is flatshard.checkpoint.get_state_dict, runtime_utils._lazy_init is as_torch._lazy_init,
          "_flat_param" in vars(FSDP), composable_fully_shard is flatshard.fully_shard,
          torch_fsdp.fully_shard is flatshard.fully_shard)
"""


@pytest.mark.parametrize("first", ["", "import transformers", "import flatshard", "import importlib.util; "
                                   "importlib.util.find_spec('torch')"])
def test_environment_variable_installs_it_at_interpreter_start_whatever_the_import_order(first):
    """transformers (and datasets, peft) probe for torch with find_spec before importing it; flatshard may be what
    imports torch first."""
    code = first + "\n" + textwrap.dedent(_PROBE)
    assert _pythons((code, True), (code, False)) == ["True True True True False True True",
                                                     "False False False False True False False"]


def test_late_install_rebinds_imported_names_and_uninstall_restores_everything():
    out = _python("""
        import types, sys
        import torch.distributed.checkpoint.state_dict as dsd
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        import torch.distributed._composable.fsdp as composable, torch.distributed.fsdp as torch_fsdp
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
        user = types.ModuleType("user_module"); sys.modules["user_module"] = user
        exec("from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict", user.__dict__)
        exec("from torch.distributed.fsdp import fully_shard", user.__dict__)
        namespaces = (FSDP, dsd, composable, torch_fsdp, FSDPState)
        before = [dict(vars(n)) for n in namespaces]
        import flatshard, flatshard.checkpoint
        flatshard.install_as_torch_fsdp()
        flatshard.install_as_torch_fsdp()  # idempotent
        print(user.get_state_dict is flatshard.checkpoint.get_state_dict,
              dsd.set_state_dict is flatshard.checkpoint.set_state_dict, FSDP.__init__ is flatshard.FSDP.__init__,
              user.fully_shard is flatshard.fully_shard, composable.fully_shard is flatshard.fully_shard)
        flatshard.uninstall_as_torch_fsdp()
        import torch.distributed.fsdp._runtime_utils as runtime_utils
        print(flatshard.is_active(), [dict(vars(n)) == b for n, b in zip(namespaces, before)],
              user.get_state_dict is before[1]["get_state_dict"], user.fully_shard is before[3]["fully_shard"],
              runtime_utils._lazy_init is flatshard._torch_facade.opt_in.TORCH_ORIGINALS["_lazy_init"])
    """, opt_in=False)
    assert out.splitlines() == ["True True True True True", "False [True, True, True, True, True] True True True"]


def test_torch_fully_shard_reached_under_the_opt_in_warns_once_naming_the_caller():
    """A reference to torch's fully_shard the opt-in cannot replace (here its defining module's, which it leaves to
    torch's own methods) still runs torch's FSDP2: warned once, with the caller's file and line; flatshard's
    fully_shard (torch's public name) does not warn, and nothing warns with the opt-in off."""
    code = """
        import tempfile, warnings, torch, torch.distributed as dist
        from torch.distributed.fsdp._fully_shard._fully_shard import fully_shard as held
        dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
        import flatshard
        from torch.distributed.fsdp import fully_shard
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ours = fully_shard(torch.nn.Linear(2, 2))
            theirs = [held(torch.nn.Linear(2, 2)) for _ in range(2)]
        said = [str(w.message) for w in caught if str(w.message).startswith("flatshard: torch's fully_shard")]
        print(getattr(ours, "_is_flatshard_unit", False), any(getattr(m, "_is_flatshard_unit", False) for m in theirs),
              len(said), all("<string>:10 (<listcomp>)" in m and "trains on torch's FSDP2" in m for m in said))
        dist.destroy_process_group()
    """
    assert _pythons((code, True), (code, False)) == ["True False 1 True", "False False 0 True"]


def _build(seed: int = 0):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # torch's name

    model = FSDP(make_gpt(seed=seed), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _local_parts(value):
    """Every tensor of a (nested) state dict as this rank holds it."""
    if isinstance(value, dict):
        return {k: _local_parts(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_local_parts(v) for v in value]
    if hasattr(value, "to_local"):
        return value.to_local().clone()
    if hasattr(value, "local_tensor"):
        return value.local_tensor().clone()
    return value.clone() if isinstance(value, torch.Tensor) else value


def _dsd_round_trip(rank, world_size, path):
    import flatshard

    flatshard.install_as_torch_fsdp()
    import torch.distributed.checkpoint.state_dict as dsd  # torch's module: its functions are flatshard's now

    model, opt = _build()
    losses = train_gpt(model, opt, range(SAVE_AT), rank, world_size)
    model_sd, optim_sd = dsd.get_state_dict(model, opt)
    saved = _local_parts({"model": model_sd, "optim": optim_sd})
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)

    model, opt = _build(seed=7)  # other weights: the checkpoint must replace them
    model_sd, optim_sd = dsd.get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    dsd.set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    model_sd, optim_sd = dsd.get_state_dict(model, opt)
    read_back = _local_parts({"model": model_sd, "optim": optim_sd})
    losses += train_gpt(model, opt, range(SAVE_AT, STEPS), rank, world_size)
    flatshard.uninstall_as_torch_fsdp()
    return losses, saved, read_back


def _assert_equal(got, want, where):
    assert type(got) is type(want), f"{where}: {type(got)} vs {type(want)}"
    if isinstance(want, dict):
        assert got.keys() == want.keys(), f"{where}: keys {sorted(got)} vs {sorted(want)}"
        for key in want:
            _assert_equal(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_equal(g, w, f"{where}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want), f"{where}: read back {got} vs saved {want}"
    else:
        assert got == want, f"{where}: {got!r} vs {want!r}"


def _uninterrupted(rank, world_size):
    from flatshard import FullyShardedDataParallel as FSDP

    model = FSDP(make_gpt(), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
    return train_gpt(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), range(STEPS), rank,
                  world_size)


def test_torch_get_set_state_dict_with_dcp_under_the_opt_in(tmp_path):
    reference = run_distributed(_uninterrupted, 2, timeout=120)[0]
    for losses, saved, read_back in run_distributed(_dsd_round_trip, 2, str(tmp_path / "ckpt"), timeout=120):
        assert losses == reference, f"resumed {losses} != uninterrupted {reference}"
        _assert_equal(read_back, saved, "")
        assert len(saved["model"]) == len(make_gpt().state_dict()) and saved["optim"]["state"]


def _internals(rank, world_size):
    import flatshard
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    flatshard.install_as_torch_fsdp()
    try:
        # (Bound after the opt-in: a module's globals bound before it are rebound, a function's locals cannot be.)
        from torch.distributed.fsdp._runtime_utils import _lazy_init

        model = FSDP(make_gpt(), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
        assert type(model) is FSDP and type(model.blocks[0]) is FSDP and flatshard.is_active()
        _lazy_init(model, model)  # torch's function, as verl calls it
        assert model._is_root and len(model._all_handles) == 4
        assert all(m._is_fsdp_managed_module for m in model.module.modules())
        with pytest.raises(AttributeError, match=r"'_exec_order_data' is torch FSDP1's private state, which "
                                                 r"flatshard does not have"):
            model._exec_order_data
        with pytest.raises(NotImplementedError, match=r"FullyShardedDataParallel._reset_lazy_init is torch FSDP1's "
                                                      r"internal, which flatshard does not have"):
            model._reset_lazy_init()
        with pytest.raises(AttributeError, match=r"has no attribute 'no_such_thing' \(nor has the wrapped 'GPT'\)"):
            model.no_such_thing
        with pytest.raises(AttributeError, match=r"'FlatParamHandle' has no attribute '_shard_param_infos'.*torch "
                                                 r"FSDP1's internal"):
            model._handle._shard_param_infos
        # torch's helpers on a model without flatshard units: torch's own functions, as before the opt-in
        import torch.distributed.checkpoint.state_dict as dsd

        plain = torch.nn.Linear(2, 2)
        assert dsd.get_model_state_dict(plain).keys() == plain.state_dict().keys()
    finally:
        flatshard.uninstall_as_torch_fsdp()


def test_torch_internals_answer_or_fail_naming_them():
    run_distributed(_internals, 1, timeout=60)
