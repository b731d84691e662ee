"""The opt-in that makes torch's FSDP1 class flatshard's: how frameworks reach flatshard.

[Note: flatshard as torch's FSDP]
HF accelerate (and the Trainer and TRL on it), Lightning and verl construct
``torch.distributed.fsdp.FullyShardedDataParallel`` inside their own code, call its
static methods (``FSDP.state_dict_type``, ``FSDP.optim_state_dict``,
``FSDP.summon_full_params``, ...) and torch's ``torch.distributed.checkpoint.state_dict``
helpers, and check ``isinstance(m, FSDP)`` and even ``type(m) is FSDP`` (accelerate's
FULL checkpoint loading). Changing an import in one's own script reaches none of that.
After ``install()`` (``flatshard.install_as_torch_fsdp()``, or
``FLATSHARD_AS_TORCH_FSDP=1`` in the environment, honoured at interpreter start by
``flatshard_as_torch_fsdp.pth``; see ``_flatshard_startup.py``):

- torch's class itself takes flatshard's members: every method, property and static
  method of flatshard's class (``__init__`` included) is set on torch's class, so that
  every name bound to it, whenever it was imported, builds and runs flatshard units
  whose type *is* torch's class. Auto-wrapped children are made with ``type(self)``.
  What torch's class defines and flatshard's does not is, by the member table
  ([Note: The member table] in members.py), replaced by an error that names it
  (``internals.py``) or removed (torch's ``_flat_param`` property: a unit's
  ``_flat_param`` is the flat parameter flatshard registers on it).
- flatshard's class calls ``nn.Module``'s methods by name, never ``super()``, so the
  same functions work on both classes.
- torch's ``torch.distributed.checkpoint.state_dict`` functions and
  ``torch.distributed.fsdp._runtime_utils._lazy_init`` (verl calls it) are replaced by
  flatshard's, in their modules and wherever an already imported module bound them by
  name (``from ... import get_state_dict`` before the opt-in).

[Note: fully_shard under the opt-in]
torch's FSDP2 function is reached by name: ``torch.distributed.fsdp.fully_shard``, the same
name in its package ``torch.distributed.fsdp._fully_shard``, and the older
``torch.distributed._composable.fsdp.fully_shard`` (transformers' ``distributed/fsdp.py``
imports it from there) with its shim module of that name. ``install()`` binds flatshard's
``fully_shard`` in each, and wherever an imported module bound torch's by name (as for the
checkpoint helpers above). torch's defining module keeps its own (torch's ``FSDPModule``
methods call ``fully_shard.state`` through it), and so does anything holding a reference
the opt-in cannot see (a default argument, a closure, a copy in a torch module such as
pipelining's): a call that still reaches torch's ``fully_shard`` while the opt-in is on
warns, once, naming its caller (``FSDPState.init``, which torch's ``fully_shard`` calls,
is wrapped meanwhile), so that nobody believes flatshard trains a model that torch's does.

``uninstall()`` puts torch's back (tests run torch's FSDP1 as their oracle in the same
process). Without the opt-in nothing of torch's is changed. Models must be wrapped
after the opt-in: a torch FSDP1 instance made before it does not work while it is on.
flatshard's own class (``flatshard.FullyShardedDataParallel``) is left as it is: under
the opt-in, construct torch's.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import warnings
from typing import Any, Callable

import torch.distributed._composable.fsdp as torch_composable_fsdp
import torch.distributed.checkpoint.state_dict as torch_dsd
import torch.distributed.fsdp as torch_fsdp
import torch.distributed.fsdp._fully_shard as torch_fully_shard_package
import torch.distributed.fsdp._fully_shard._fsdp_state as torch_fsdp_state
import torch.distributed.fsdp._runtime_utils as torch_runtime_utils
from torch import nn

from flatshard._common import is_unit, logger
from flatshard._torch_facade import members
from flatshard.checkpoint import _state_dict_api

ENV_VAR = "FLATSHARD_AS_TORCH_FSDP"
TorchFSDP = torch_fsdp.FullyShardedDataParallel

_lock = threading.Lock()
_active = False
# What install() changed, to undo: (owner, name, original or _ABSENT).
_undo: list[tuple[Any, str, Any]] = []
_ABSENT = object()
# torch's own functions, captured before any patching (what install() replaces, and _lazy_init's fallback).
TORCH_ORIGINALS: dict[str, Callable] = dict(_state_dict_api.TORCH_FUNCTIONS)
TORCH_ORIGINALS["_lazy_init"] = torch_runtime_utils._lazy_init
TORCH_ORIGINALS["fully_shard"] = torch_fsdp.fully_shard
# Where a script or framework finds torch's fully_shard by name (see [Note: fully_shard under the opt-in]).
_FULLY_SHARD_NAMESPACES = (torch_fsdp, torch_fully_shard_package, torch_composable_fsdp,
                           sys.modules["torch.distributed._composable.fsdp.fully_shard"])
_warned_torch_fully_shard = False


def environment_asks() -> bool:
    """Whether ``FLATSHARD_AS_TORCH_FSDP`` asks for the opt-in (as ``_flatshard_startup.wanted``)."""
    return os.environ.get(ENV_VAR, "").strip().lower() not in ("", "0", "false", "no", "off")


def is_active() -> bool:
    """Whether torch's FSDP1 class currently gives flatshard's (see [Note: flatshard as torch's FSDP])."""
    return _active


def install(reason: str = "flatshard.install_as_torch_fsdp()") -> None:
    """Makes ``torch.distributed.fsdp.FullyShardedDataParallel`` (and its static methods, torch's
    ``torch.distributed.checkpoint.state_dict`` helpers, ``_runtime_utils._lazy_init``) flatshard's,
    in this process. Idempotent."""
    global _active, _warned_torch_fully_shard
    with _lock:
        if _active:
            return
        _warned_torch_fully_shard = False
        try:
            _patch()
        except BaseException:
            _undo_all()  # nothing half-patched
            raise
        _active = True
    logger.info("flatshard: torch.distributed.fsdp.FullyShardedDataParallel is flatshard's (%s)", reason)


def uninstall() -> None:
    """Puts back everything ``install`` changed."""
    global _active
    with _lock:
        _undo_all()
        _active = False


def _patch() -> None:
    from flatshard._torch_facade.internals import refused_torch_methods
    from flatshard.fully_sharded_data_parallel import FullyShardedDataParallel

    refused = refused_torch_methods(TorchFSDP, FullyShardedDataParallel)
    for name, value in _flatshard_members().items():
        _set(TorchFSDP, name, value)
    for name, value in refused.items():
        _set(TorchFSDP, name, value)
    for name in members.removed_names():  # (torch's _flat_param property: a unit's is the parameter flatshard registers)
        if name in vars(TorchFSDP):
            _set(TorchFSDP, name, _ABSENT)
    replacements = {TORCH_ORIGINALS[name]: getattr(_state_dict_api, name)
                    for name in _state_dict_api.TORCH_FUNCTIONS}
    replacements[TORCH_ORIGINALS["_lazy_init"]] = _lazy_init
    for name in _state_dict_api.TORCH_FUNCTIONS:
        _set(torch_dsd, name, replacements[TORCH_ORIGINALS[name]])
    _set(torch_runtime_utils, "_lazy_init", _lazy_init)
    # torch's FSDP2 (see [Note: fully_shard under the opt-in])
    from flatshard._fully_shard import fully_shard

    replacements[TORCH_ORIGINALS["fully_shard"]] = fully_shard
    for namespace in _FULLY_SHARD_NAMESPACES:
        if getattr(namespace, "fully_shard", None) is TORCH_ORIGINALS["fully_shard"]:
            _set(namespace, "fully_shard", fully_shard)
    _set(torch_fsdp_state.FSDPState, "init", _warning_init(torch_fsdp_state.FSDPState.init))
    _rebind_imported(replacements)


def _undo_all() -> None:
    while _undo:
        owner, name, original = _undo.pop()
        if original is _ABSENT:
            delattr(owner, name)
        elif isinstance(owner, dict):
            owner[name] = original
        else:
            setattr(owner, name, original)


def _set(owner: Any, name: str, value: Any) -> None:
    """``owner.name = value`` (deleted for ``_ABSENT``), recorded for ``uninstall``."""
    _undo.append((owner, name, owner.__dict__.get(name, _ABSENT) if isinstance(owner, type) else getattr(owner, name)))
    if value is _ABSENT:
        delattr(owner, name)
    else:
        setattr(owner, name, value)


def _rebind_imported(replacements: dict[Callable, Callable]) -> None:
    """Names bound to torch's functions in modules imported before the opt-in (``from
    torch.distributed.checkpoint.state_dict import get_state_dict``) get flatshard's too."""
    for module_name, module in list(sys.modules.items()):
        if module is None or module_name.startswith(("flatshard", "torch.")):
            continue
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            try:
                replacement = replacements.get(value)
            except Exception:  # unhashable, or a __hash__ that raises
                continue
            if replacement is not None:
                _undo.append((namespace, name, value))
                namespace[name] = replacement


def _warning_init(torch_init: Callable) -> Callable:
    """torch's ``FSDPState.init``, warning once that torch's ``fully_shard`` runs while the opt-in is on."""

    @functools.wraps(torch_init)
    def init(self: Any, *args: Any, **kwargs: Any) -> Any:
        global _warned_torch_fully_shard
        if _active and not _warned_torch_fully_shard:
            _warned_torch_fully_shard = True
            where = _caller_outside_torch()
            warnings.warn(
                f"flatshard: torch's fully_shard was called from {where} while flatshard's opt-in is on, through a "
                f"reference the opt-in cannot replace: that module trains on torch's FSDP2, not flatshard's. Import "
                f"fully_shard where it is called (from torch.distributed.fsdp, which the opt-in covers), or call "
                f"flatshard.fully_shard.", UserWarning, stacklevel=2)
        return torch_init(self, *args, **kwargs)

    return init


def _caller_outside_torch() -> str:
    """``file:line (function)`` of the innermost frame that is neither torch's nor this module's."""
    import torch

    torch_dir = os.path.dirname(torch.__file__)
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(torch_dir) and filename != __file__:
            return f"{filename}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "torch itself"


def _lazy_init(state: Any, root_module: nn.Module) -> Any:
    """torch's ``_runtime_utils._lazy_init(state, root_module)`` (verl calls it before reaching into
    ``_all_handles``): on a flatshard unit, flatshard's lazy init."""
    if is_unit(state):
        state._lazy_init()
        return state
    return TORCH_ORIGINALS["_lazy_init"](state, root_module)


def _flatshard_members() -> dict[str, Any]:
    """Every attribute flatshard's class (and its mixins) defines, as torch's class gets them."""
    from flatshard.fully_sharded_data_parallel import FullyShardedDataParallel

    members: dict[str, Any] = {}
    for klass in reversed(FullyShardedDataParallel.__mro__):
        if klass in (nn.Module, object):
            continue
        for name, value in vars(klass).items():
            if name not in ("__dict__", "__weakref__", "__module__", "__doc__", "__qualname__", "__annotations__"):
                members[name] = value
    return members
