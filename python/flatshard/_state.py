"""Where a unit's state lives: one ``UnitState`` per unit, one ``RootState`` per root.

[Note: Unit state]
Every ``FullyShardedDataParallel`` holds one ``UnitState`` as ``_unit_state`` (in its
``__dict__``: not a submodule, not a parameter), made at wrap time, and nothing else of
flatshard's is set on the module but the flat parameter (``_flat_param``, torch's name)
and the wrapped module. The fields come in four groups: identity and configuration
(its name, its module and the frozen ``UnitConfig`` its front-end resolved: groups,
strategy, prefetch, dtypes, offload; see [Note: Unit configuration] in _config.py),
storage (its device, the C++ ``FlatParamHandle`` and how the original parameters map onto
it), per step (what the lifecycle changes) and what the user sets between steps (the
communication hook, the state-dict settings, a load under way).

A root is made at lazy init (the first forward, or the first call that needs the
runtime): the outermost unit gets a ``RootState`` that holds the scheduler, the units
in order, the rank guard and the per-iteration orders, and every unit below it points
at that one ``RootState`` (``UnitState.root``). Undoing lazy init (``apply()`` on a unit
that may not be the real root) drops every unit's pointer and ``is_root``: nothing of a
root survives it, so there is nothing to reset by hand.

``TrainingState`` is the unit's place in the step. It changes in one place,
``UnitState.switch(hook)``, which every hook that moves it calls: ``TRANSITIONS`` says,
per hook, the states the unit may be in when the hook runs and the one it leaves it in,
and a hook that finds another raises an error naming the unit, the hook and the state
(see [Note: Unit lifecycle] in _runtime.py):
  IDLE -> FORWARD -> IDLE                    a forward call
  IDLE -> PRE_BACKWARD -> POST_BACKWARD      each use's backward, in reverse
  POST_BACKWARD -> PRE_BACKWARD              the next use of a unit called twice
  * -> IDLE                                  the root's end of backward (or abort)
  IDLE -> SUMMONING -> IDLE                  summon_full_params, apply, state dicts
A recomputation (activation checkpointing reruns a forward during backward) puts the
unit in PRE_BACKWARD: its gradients come next. A summon, or a forward of a unit called by
itself (not through its root), may also find a unit whose backward raised (PRE_ or
POST_BACKWARD until the root's next forward drops that backward), and a framework's reset
(``training_state = IDLE``) any state but SUMMONING. A unit called inside its own forward,
or a backward through it during its forward, is the caller's misuse: a UsageError before
the switch.
"""

from __future__ import annotations

import enum
import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from flatshard.api import FullOptimStateDictConfig, FullStateDictConfig, StateDictType

if TYPE_CHECKING:
    from flatshard import _C
    from flatshard._config import UnitConfig
    from flatshard._rank_guard import RankGuard
    from flatshard.fully_sharded_data_parallel import FullyShardedDataParallel


class TrainingState(enum.Enum):
    """A unit's place in the step (see [Note: Unit state])."""

    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre-backward"
    POST_BACKWARD = "post-backward"
    SUMMONING = "summoning"


# (Tuples, not sets: a membership test compares identities, where a set would call Enum's Python-level __hash__,
# five times per unit per step.)
_IDLE_OR_IN_BACKWARD = (TrainingState.IDLE, TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD)
_ANY = tuple(TrainingState)

# hook: (the states the unit may be in when the hook runs, the state it leaves the unit in); see [Note: Unit state].
TRANSITIONS: dict[str, tuple[tuple[TrainingState, ...], TrainingState]] = {
    # (a unit called by itself, not through its root, after a backward that raised: the root's next forward
    # drops that backward)
    "forward": (_IDLE_OR_IN_BACKWARD, TrainingState.FORWARD),
    "end of forward": ((TrainingState.FORWARD,), TrainingState.IDLE),
    "recompute": (_IDLE_OR_IN_BACKWARD, TrainingState.PRE_BACKWARD),
    "pre-backward": (_IDLE_OR_IN_BACKWARD, TrainingState.PRE_BACKWARD),
    "post-backward": ((TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD), TrainingState.POST_BACKWARD),
    "frozen post-backward": (_IDLE_OR_IN_BACKWARD, TrainingState.POST_BACKWARD),
    "end of backward": (_ANY, TrainingState.IDLE),
    "abort of backward": (_ANY, TrainingState.IDLE),
    "summon": (_IDLE_OR_IN_BACKWARD, TrainingState.SUMMONING),
    "end of summon": ((TrainingState.SUMMONING,), TrainingState.IDLE),
    "reset": (tuple(t for t in TrainingState if t is not TrainingState.SUMMONING), TrainingState.IDLE),
}


class UnitState:
    """Everything flatshard keeps about one unit (see [Note: Unit state])."""

    __slots__ = (
        # --- identity and configuration: fixed at wrap time
        "name",  # the unit's path under its root ("" for the root); final at lazy init
        "wrapped_module",  # what the unit calls: its _fsdp_wrapped_module (torch's ``unit.module`` is the module
        # inside an activation-checkpoint wrapper put around it after wrapping)
        "members",  # fully_shard of a list: its modules (see [Note: A list of modules] in _fully_shard.py); else ()
        "apart_units",  # fully_shard: the units made of its parameters on meshes of their own (see [Note: Parameters
        # on a mesh of their own] in _param_meshes.py), gathered with it where it is prefetched explicitly
        "config",  # the UnitConfig its front-end resolved (see [Note: Unit configuration] in _config.py)
        # --- storage
        "device",  # where the unit computes and its storage lives (see [Note: Unit configuration])
        "handle",  # the C++ FlatParamHandle, or None for a unit without parameters of its own
        "replicated",  # the handle's shard is the whole flat parameter (shard factor 1)
        "placeholders",  # the handle's placeholder views (see [Note: Placeholders] in flat_param.h)
        "shard_dtype",  # the shard's dtype the handle's buffers were made for
        "flat_param",  # the local shard as an nn.Parameter (registered as _flat_param unless use_orig_params)
        "param_slots",  # [(module, attribute, index into the flat order)], one per registration of a parameter
        "param_names",  # the parameters' full names at wrap time, in flat order
        "param_local_names",  # their names relative to the wrapped module
        "frozen_indices",  # use_orig_params: frozen parameters of a trainable unit
        "orig_params",  # use_orig_params: the original nn.Parameters, in flat order
        "fsdp2_param_order",  # fully_shard: the orig_params in torch's FSDP2 order (indices; see _fsdp2_param_order)
        "orig_grad_seen",  # use_orig_params: which got a gradient since the last reduced backward
        "orig_grad_held",  # use_orig_params: which hold a .grad from the shard (given, not set to None since)
        "reduce_unused",  # fully_shard's set_reduce_scatter_unused_params: every parameter counts as seen
        "reduce_scatter_group",  # fully_shard's set_separate_reduce_scatter_group: its reduce-scatters' group, or None
        "reduce_scatters_in_flight",  # fully_shard's set_reduce_scatter_max_input_buffers (its root's scheduler takes
        # the largest of its units': see [Note: Reductions in flight] in csrc/flatshard/scheduler.h)
        "all_reduce_hook",  # fully_shard's set_all_reduce_hook (see [Note: The all-reduce hook] in flat_param.h)
        "orig_grads_given",  # use_orig_params: weak references to (the flat gradient, [(each .grad given from it (None
        # for none), its data_ptr)]) at the last use_grad_views, or None (see _orig_params.write_back_grads)
        "buffer_orig_dtypes",  # (module, buffer name) -> dtype before buffer_dtype's cast
        # --- per step
        "root",  # the RootState of this unit's root, set at lazy init; None before
        "is_root",  # None before lazy init
        "training_state",
        "uses",  # live uses of the parameters by autograd (see _runtime.Use)
        "placeholders_set",  # whether the modules hold the storage-less placeholders
        "explicit_unshard",  # whether they hold unshard()'s nn.Parameters: a forward or backward hands out its views
        "forward_use",  # fully_shard: (a weak reference to the use whose views the modules hold from a forward, the
        # root's forward_serial then), else None (a later forward of the unit before it reshards takes the same views: see [Note: One set of unsharded
        # parameters per gathering] in _runtime.py)
        "gather_bytes",  # the unsharded parameters' bytes (what gathering the unit allocates)
        "sync_gradients",  # False inside no_sync()
        "grads_handed_out",  # fully_shard: this backward's gradients already are the parameters' .grad, handed out
        # before its end for their post-accumulate-grad hooks (see [Note: Post-accumulate-grad hooks] in
        # _dtensor_params.py)
        "gradient_gaps",  # its trainable parameters that got no gradient then, for the rank guard (indices)
        "reshards_after_backward",  # fully_shard's set_reshard_after_backward: False keeps the parameters unsharded
        # after backward, until a forward that reshards (gradient accumulation without the all-gathers)
        "forward_call",  # fully_shard: what its forward pre-hook hands its forward hook: (_runtime.ForwardCall,
        # the exception the caller was handling then, or None)
        "in_forward_method",  # fully_shard: inside a method torch's register_fsdp_forward_method wraps (see [Note:
        # Forward methods] in _fsdp_module.py), whose own forwards are part of its call
        "nested_forwards",  # how many of those forwards are running now
        "method_ran_forward",  # whether one ran during the method's call (the root then reshards after it, as torch's)
        "dim0_rows",  # fully_shard: where each parameter's rows are in the shard (_dtensor_params._rows)
        "tp_params",  # fully_shard: {index: _tensor_parallel.TPParam} of the parameters that were DTensors over a TP
        # mesh (see [Note: Tensor-parallel parameters]); before the construction, keyed by id of their local parameter
        "tp_partial",  # {index: this backward's sum of its Partial gradients} (see [Note: Partial gradients of
        # tensor-parallel parameters])
        "tp_partial_acc",  # {index: earlier backwards' sums, in the reduce dtype} (gradient accumulation without sync)
        "tp_specs",  # {(index, dtype): the DTensorSpec its unsharded DTensor has}
        "holds_unsharded",  # inside no_sync(keep_parameters_unsharded=True): nothing reshards (see [Note: no_sync])
        "forward_prefetch_to",  # fully_shard's set_modules_to_forward_prefetch: the units gathered after this one's
        # own all-gather in its pre-forward (None: the runtime's own rule)
        "backward_prefetch_to",  # and set_modules_to_backward_prefetch, in its pre-backward
        "forward_input_dtype",  # what forward inputs are cast to, or None (set at lazy init)
        # --- set by the user between steps: the communication hook, state dicts
        "comm_hook",  # a user's communication hook, or None
        "comm_hook_state",
        "state_dict_type",
        "state_dict_config",
        "optim_state_dict_config",
        "dtensor_mesh",  # the unit's DTensor mesh (cached), or None
        "loading",  # during load_state_dict: whether an outer unit loaded this one ("done"), and the missing keys
        "plain_state_dict",  # answer state_dict() as a plain module (inside an outer unit's sharded state_dict)
    )

    def __init__(self, name: str, module: nn.Module, config: UnitConfig, device: torch.device) -> None:
        self.name = name
        self.wrapped_module = module
        self.config = config
        self._init_fully_shard()

        self.device = device
        self.handle: _C.FlatParamHandle | None = None
        self.replicated = False
        self.gather_bytes = 0
        self.placeholders: list[torch.Tensor] = []
        self.shard_dtype: torch.dtype | None = None
        self.flat_param: nn.Parameter | None = None
        self.param_slots: list[tuple[nn.Module, str, int]] = []
        self.param_names: list[str] = []
        self.param_local_names: list[str] = []
        self.frozen_indices: list[int] = []
        self.orig_params: list[nn.Parameter] = []
        self.orig_grad_seen: list[bool] = []
        self.orig_grad_held: list[bool] = []
        self.orig_grads_given: tuple[weakref.ref, list[tuple[weakref.ref | None, int]]] | None = None
        self.buffer_orig_dtypes: dict[tuple[nn.Module, str], torch.dtype] = {}

        self.root: RootState | None = None
        self.is_root: bool | None = None
        self.training_state = TrainingState.IDLE
        self.uses: weakref.WeakSet[Any] = weakref.WeakSet()
        self.placeholders_set = True
        self.explicit_unshard = False
        self.sync_gradients = True
        self.gradient_gaps: list[int] = []
        self.reshards_after_backward = True
        self.holds_unsharded = False
        self.forward_input_dtype: torch.dtype | None = None
        self.comm_hook: Callable | None = None
        self.comm_hook_state: object = None
        self.state_dict_type = StateDictType.FULL_STATE_DICT
        self.state_dict_config: Any = FullStateDictConfig()
        self.optim_state_dict_config: Any = FullOptimStateDictConfig()
        self.dtensor_mesh: Any = None
        self.loading: dict[str, Any] = {}
        self.plain_state_dict = False

    def _init_fully_shard(self) -> None:
        """What fully_shard's front-end keeps (its FSDPModule setters' values, its hooks' state, its DTensor and
        tensor-parallel parameters' bookkeeping); the class's units keep these values."""
        self.members: tuple[nn.Module, ...] = ()
        self.apart_units: tuple[UnitState, ...] = ()
        self.in_forward_method = False
        self.nested_forwards = 0
        self.method_ran_forward = False
        self.forward_prefetch_to: list[UnitState] | None = None
        self.backward_prefetch_to: list[UnitState] | None = None
        self.fsdp2_param_order: list[int] = []
        self.reduce_unused = False
        self.reduce_scatters_in_flight = 1
        self.reduce_scatter_group: Any = None
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self.forward_use: tuple[weakref.ref, int] | None = None
        self.grads_handed_out = False
        self.forward_call: Any = None
        self.dim0_rows: list | None = None
        self.tp_params: dict = {}
        self.tp_partial: dict = {}
        self.tp_partial_acc: dict = {}
        self.tp_specs: dict = {}

    def switch(self, hook: str) -> None:
        """The one place a unit's training state changes (see [Note: Unit state]): ``hook`` is a key of
        ``TRANSITIONS``; a state it does not allow is flatshard's error, raised naming the unit."""
        allowed, to = TRANSITIONS[hook]
        if self.training_state not in allowed:
            raise RuntimeError(
                f"flatshard: unit '{self.label}' reached its {hook} in state {self.training_state.name} (expected "
                f"{' or '.join(sorted(s.name for s in allowed))}). This is flatshard's error: please report it with "
                f"the code that led here.")
        self.training_state = to

    @property
    def label(self) -> str:
        """How error messages name the unit: its name, or ``<root>``."""
        return self.name or "<root>"

    def storage_changed(self) -> None:
        """After the handle was made, or remade its buffers (a cast): the values read from it."""
        self.replicated = self.handle.is_replicated
        self.gather_bytes = self.handle.unsharded_nbytes
        self.placeholders = list(self.handle.placeholder_views)
        self.shard_dtype = self.handle.local_shard.dtype

    def drop_root(self) -> None:
        """Undoes lazy init for this unit (see [Note: Unit state])."""
        self.root = None
        self.is_root = None


class RootState:
    """What one root holds for every unit below it (see [Note: Unit state])."""

    __slots__ = (
        "unit",  # the root FullyShardedDataParallel
        "scheduler",  # the C++ Scheduler every unit of this root uses
        "units",  # every unit, the root first, in module order (the same on every rank)
        "group_pairs",  # (id(shard group), id(replicate group), id(reduce-scatter group)) -> the scheduler's pair
        "orig_param_units",  # the units with use_orig_params and parameters
        "sharded_handles",  # the handles of the units that all-gather (not replicated)
        "guard",  # the RankGuard, or None (off)
        "gradient_pattern",  # the guard's digest of which parameters got a .grad in the last backward (see
        # [Note: Gradients given on some ranks only] in _rank_guard.py)
        "without_grad",  # those parameters' names, for the guard's error
        # --- per iteration (see [Note: Unit lifecycle] in _runtime.py)
        "in_iteration",  # a forward ran and its backward has not ended
        "first_use",  # a weak reference to the iteration's first use (its first forward's graph), or None
        "in_forward_call",  # the root's forward is running (summoning then is refused)
        "final_callback_queued",  # the end of backward is queued with autograd
        "backward_task",  # the graph task of the backward under way, or -1
        "pre_forward_order",  # units in the order their forward started, this iteration
        "iteration_trains",  # this iteration's first forward ran with grad
        "forward_prefetch_order",  # pre_forward_order of the last iteration that trained (see [Note: Forward
        # prefetch] in _runtime.py)
        "prefetched_ahead",  # the unit the last pre-forward's prefetch gathered, until its own pre-forward, or None
        "gathered_ahead",  # units a prefetch gathered together with its own (see [Note: Small units gathered
        # together] in csrc/flatshard/scheduler.h), until their own pre-forward or pre-backward, or a reshard
        "gather_together_bytes",  # the root's config.gather_together_bytes
        "forward_serial",  # counts the root's forwards: a unit's held views serve later calls within one (forward_use)
        "hooks_waiting",  # fully_shard units whose post-accumulate-grad hooks wait for their reduction, deferred to go
        # together with the next units', in post-backward order (see [Note: Post-accumulate-grad hooks])
        "post_forward_order",  # units in the order their forward ended (backward prefetch)
        "recompute_order",  # the same, for a rerun of the whole model (see [Note: Recomputation])
        "recomputing",  # the whole model is being rerun
        "inner_gathered",  # units a backward inside the forward gathered, to free at its end (see [Note: A backward
        # inside the forward] in _backward.py)
        "taken_over",  # another root took some of its units over (see _runtime.lazy_init)
        "shards_on_host",  # the shards were moved to host memory (see [Note: Shards on the host])
        "__weakref__",  # (the exit drain holds roots weakly)
    )

    def __init__(self, unit: FullyShardedDataParallel, scheduler: _C.Scheduler,
                 units: list[FullyShardedDataParallel]) -> None:
        self.unit = unit
        self.scheduler = scheduler
        self.units = units
        self.group_pairs: dict[tuple[int, int, int], int] = {}
        self.orig_param_units = [u for u in units if u._unit_state.config.use_orig_params and u._unit_state.handle is not None]
        self.sharded_handles = [u._unit_state.handle for u in units
                                if u._unit_state.handle is not None and not u._unit_state.replicated]
        self.guard: RankGuard | None = None
        self.gradient_pattern = 0
        self.without_grad: list[tuple[str, list[str]]] = []
        self.in_iteration = False
        self.first_use: weakref.ref | None = None
        self.in_forward_call = False
        self.final_callback_queued = False
        self.backward_task = -1
        self.pre_forward_order: list[UnitState] = []
        self.iteration_trains = False
        self.forward_prefetch_order: list[UnitState] = []
        self.prefetched_ahead: UnitState | None = None
        self.gathered_ahead: set[UnitState] = set()
        self.hooks_waiting: list[UnitState] = []
        self.forward_serial = 0
        self.gather_together_bytes = unit._unit_state.config.gather_together_bytes
        self.post_forward_order: list[UnitState] = []
        self.recompute_order: list[UnitState] = []
        self.recomputing = False
        self.inner_gathered: list[UnitState] = []
        self.taken_over = False
        self.shards_on_host = False

