"""torch FSDP1 internals that frameworks reach for: the ones flatshard answers, and errors for the rest.

[Note: torch's internals]
Beyond torch's public attributes (``attributes.py``), frameworks read some of
FSDP1's private state: verl walks ``model._all_handles`` (after torch's ``_lazy_init``)
and moves each ``handle.flat_param`` to the host and back (``handle.flat_param_to``,
``flat_param._local_shard``); transformers' ``generate()`` and torch.compile look for
``_is_fsdp_managed_module`` on the modules a unit manages. flatshard answers these over
its own state (``_all_handles`` are ``HandleView`` s; moving a flat parameter goes through
``_host_offload``, which keeps the runtime's buffers and views in step).

Everything else of torch's private state has no meaning here: a missing attribute that
torch's FSDP1 defines raises an ``AttributeError`` that names it as a torch FSDP1 internal
flatshard does not have, and under the opt-in (see [Note: flatshard as torch's FSDP])
torch's private methods that flatshard's class lacks raise ``NotImplementedError`` naming
the method, rather than running torch's code over state that is not there.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from torch import nn

from flatshard._torch_facade import members

# torch FSDP1's private instance state (set by _FSDPState.__init__ and _init_utils), less
# what flatshard answers (see attributes.py).
TORCH_PRIVATE_STATE = frozenset({
    "_all_fsdp_states", "_buffer_name_to_orig_dtype", "_buffer_names", "_comm_hook", "_comm_hook_state",
    "_debug_level", "_device_handle", "_device_mesh", "_exec_order_data", "_free_event_queue", "_fsdp_extension",
    "_fully_sharded_module_to_handle", "_gradient_postdivide_factor", "_gradient_predivide_factor",
    "_ignored_buffer_names", "_ignored_modules", "_ignored_params", "_inter_node_pg", "_inter_node_state",
    "_optim_state_dict_config", "_post_forward_handles", "_pre_forward_handles", "_root_pre_forward_handles",
    "_state_dict_config", "_unshard_event", "_unshard_params_ctx", "_use_full_prec_in_eval",
    "_streams", "_default_stream", "_unshard_stream", "_post_backward_stream", "_pre_unshard_stream",
    "_all_reduce_stream", "_limiter", "_needs_pre_backward_unshard", "_post_backward_callback_queued",
})

_ALTERNATIVES = (
    "flatshard keeps a unit's state in `unit._unit_state` (see [Note: Unit state]); torch's public "
    "attributes and `_handle` are there (README: 'torch FSDP1's attributes and handle'), and "
    "`flatshard.move_shards_to_host` / `move_shards_to_device` move the shards"
)


def missing_attribute(unit: nn.Module, name: str) -> AttributeError:
    """The error for an attribute neither the unit nor its wrapped module has."""
    module_name = type(unit._fsdp_wrapped_module).__name__
    if name in TORCH_PRIVATE_STATE:
        return AttributeError(
            f"'FullyShardedDataParallel' object has no attribute '{name}': '{name}' is torch FSDP1's private "
            f"state, which flatshard does not have ({_ALTERNATIVES})."
        )
    return AttributeError(
        f"'FullyShardedDataParallel' object has no attribute '{name}' (nor has the wrapped '{module_name}')"
    )


def refused_torch_methods(torch_class: type, flatshard_class: type) -> dict[str, Callable]:
    """For each method of torch's FSDP1 class that the member table refuses (or does not know), and flatshard's
    class does not define: one that raises NotImplementedError naming it (set on torch's class under the opt-in;
    see [Note: The member table])."""
    ours = {name for klass in flatshard_class.__mro__ if klass is not object for name in vars(klass)}
    return {name: _refusing(name, isinstance(inspect.getattr_static(torch_class, name), staticmethod))
            for name in members.refused_names(torch_class) if name not in ours}


def _refusing(name: str, static: bool) -> Callable:
    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise NotImplementedError(
            f"FullyShardedDataParallel.{name} is torch FSDP1's internal, which flatshard does not have ({_ALTERNATIVES})."
        )

    refuse.__name__ = refuse.__qualname__ = name
    return staticmethod(refuse) if static else refuse
