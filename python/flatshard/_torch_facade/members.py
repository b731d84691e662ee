"""Every member of torch's FSDP1 class, and what flatshard's facade does with it.

[Note: The member table]
torch's ``FullyShardedDataParallel`` defines its members (methods, properties, static methods; its
instance state is [Note: torch's internals]). Under the opt-in (opt_in.py) torch's class takes
every member of flatshard's class, and each member of torch's own is, by ``TORCH_MEMBERS``:
- PROVIDED: flatshard's class defines it, with torch's meaning;
- REFUSED: calling it raises NotImplementedError naming it (internals.py) rather than run torch's
  code over state that is not there;
- NOT_NEEDED: removed from torch's class under the opt-in; the reason says what stands for it.
A member torch's class has and the table lacks (a torch release added or renamed one) is refused
like a REFUSED one, so that torch's code never runs on a flatshard unit, and fails
tests/test_torch_facade.py until the table says what it is; so does a PROVIDED member flatshard's
class lacks.
"""

from __future__ import annotations

from torch import nn

PROVIDED, REFUSED, NOT_NEEDED = "provided", "refused", "not needed"

# Class-level names every class has: not members of torch's FSDP.
_NOT_MEMBERS = frozenset({"__module__", "__doc__", "__dict__", "__weakref__", "__qualname__", "__annotations__",
                          "__firstlineno__", "__static_attributes__", "__parameters__", "__orig_bases__"})

TORCH_MEMBERS: dict[str, tuple[str, str]] = {
    "__init__": (PROVIDED, "torch's constructor arguments"),
    "__getattr__": (PROVIDED, "the wrapped module's attributes; torch's private state named in the error"),
    "__getitem__": (PROVIDED, "indexing the wrapped module"),
    "module": (PROVIDED, "the wrapped module (inside an activation-checkpoint wrapper, the module it wraps)"),
    "_has_params": (PROVIDED, "whether the unit has parameters of its own"),
    "_flat_param": (NOT_NEEDED, "a unit's _flat_param is the flat parameter flatshard registers on the unit, not "
                                "torch's property over its handle"),
    "check_is_root": (PROVIDED, "lazy init, then whether the unit is the root"),
    "fsdp_modules": (PROVIDED, "the units in a module tree"),
    "apply": (PROVIDED, "fn over the summoned full parameters"),
    "_apply": (PROVIDED, "casts the shards; inside summon_full_params moves or casts the full parameters"),
    "_mixed_precision_enabled_for_buffers": (REFUSED, "flatshard's buffer_dtype is applied at wrap time"),
    "_low_precision_hook_enabled": (REFUSED, "register_comm_hook's hooks run in flatshard's reduction"),
    "_reset_lazy_init": (REFUSED, "flatshard undoes lazy init itself where it must (a unit wrapped by a new root)"),
    "set_state_dict_type": (PROVIDED, "the state dict type and configs of every unit"),
    "get_state_dict_type": (PROVIDED, "the state dict settings, checked the same on every unit"),
    "state_dict_type": (PROVIDED, "a context with the state dict type"),
    "forward": (PROVIDED, "the unit lifecycle"),
    "summon_full_params": (PROVIDED, "torch's context, refusing what torch refuses"),
    "_deregister_orig_params_ctx": (REFUSED, "flatshard keeps the original parameters registered"),
    "named_buffers": (PROVIDED, "torch's names (without _fsdp_wrapped_module inside summon_full_params)"),
    "named_parameters": (PROVIDED, "torch's names (without _fsdp_wrapped_module inside summon_full_params)"),
    "_assert_state": (PROVIDED, "asserts torch's TrainingState"),
    "no_sync": (PROVIDED, "gradient accumulation without reduction"),
    "clip_grad_norm_": (PROVIDED, "the norm over every rank's shards"),
    "_warn_optim_input": (REFUSED, "torch's deprecation warning for its optim_input argument"),
    "_is_using_optim_input": (REFUSED, "torch's deprecation check for its optim_input argument"),
    "_warn_legacy_optim_state_dict": (REFUSED, "torch's deprecation warning for its legacy optimizer state dict API"),
    "_optim_state_dict_impl": (REFUSED, "optim_state_dict is flatshard's own (the public method is provided)"),
    "_optim_state_dict_to_load_impl": (REFUSED, "optim_state_dict_to_load is flatshard's own (the public method is "
                                                "provided)"),
    "full_optim_state_dict": (PROVIDED, "torch's legacy optimizer state dict API"),
    "sharded_optim_state_dict": (PROVIDED, "torch's legacy optimizer state dict API"),
    "shard_full_optim_state_dict": (PROVIDED, "torch's legacy optimizer state dict API"),
    "flatten_sharded_optim_state_dict": (PROVIDED, "torch's legacy optimizer state dict API"),
    "scatter_full_optim_state_dict": (PROVIDED, "torch's legacy optimizer state dict API"),
    "rekey_optim_state_dict": (PROVIDED, "torch's legacy optimizer state dict API"),
    "optim_state_dict": (PROVIDED, "the optimizer state dict in torch's format"),
    "optim_state_dict_to_load": (PROVIDED, "torch's format back to the optimizer's"),
    "register_comm_hook": (PROVIDED, "communication hooks, torch's defaults and users'"),
    "_unshard": (PROVIDED, "all-gathers the unit's parameters (torch's private API that frameworks call)"),
    "_wait_unshard_streams_on_current_stream": (PROVIDED, "orders the current stream after the all-gathers"),
    "_use_training_state": (REFUSED, "flatshard switches a unit's training state in its runtime"),
}


def torch_members(torch_class: type) -> dict[str, object]:
    """The members torch's class defines itself (its FSDP bases included, ``nn.Module``'s not)."""
    out: dict[str, object] = {}
    for klass in reversed(torch_class.__mro__):
        if klass in (nn.Module, object):
            continue
        out.update({name: value for name, value in vars(klass).items() if name not in _NOT_MEMBERS})
    return out


def table_problems(torch_class: type, flatshard_class: type) -> list[str]:
    """What the table gets wrong about these two classes (see the Note): each a sentence naming the member."""
    ours = {name for klass in flatshard_class.__mro__ if klass not in (nn.Module, object) for name in vars(klass)}
    theirs = torch_members(torch_class)
    problems = []
    for name in sorted(theirs.keys() - TORCH_MEMBERS.keys()):
        problems.append(f"torch's FSDP1 class has {name!r}, which flatshard's member table "
                        "(flatshard/_torch_facade/members.py) does not list: provide it in flatshard's class, or "
                        "list it as refused or not needed, with the reason")
    for name in sorted(TORCH_MEMBERS.keys() - theirs.keys()):
        problems.append(f"flatshard's member table lists {name!r}, which torch's FSDP1 class no longer has: drop it "
                        "from the table (or torch renamed it: list the new name)")
    for name, (what, _) in sorted(TORCH_MEMBERS.items()):
        if what == PROVIDED and name not in ours:
            problems.append(f"flatshard's member table says {name!r} is provided, but flatshard's class lacks it")
        if what != PROVIDED and name in ours:
            problems.append(f"flatshard's class defines {name!r}, which the member table lists as {what}: list it as "
                            "provided")
    return problems


def refused_names(torch_class: type) -> list[str]:
    """torch's members to refuse under the opt-in: REFUSED, and any the table lacks (see the Note)."""
    return sorted(name for name, value in torch_members(torch_class).items()
                  if TORCH_MEMBERS.get(name, (REFUSED,))[0] == REFUSED and callable(getattr(torch_class, name, None)))


def removed_names() -> list[str]:
    """torch's members removed from its class under the opt-in."""
    return sorted(name for name, (what, _) in TORCH_MEMBERS.items() if what == NOT_NEEDED)
