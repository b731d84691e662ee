"""torch FSDP1's attributes on a unit, read from the unit's state.

[Note: torch's attributes]
Tests and frameworks read torch FSDP1's instance attributes (``model.process_group``,
``model.sharding_strategy``, ``model.params``, ``model.training_state``, ...). flatshard
keeps its state in one ``UnitState`` (see [Note: Unit state]); these read-only
properties answer with torch's names, types and values: torch's own enums and config
dataclasses (``MixedPrecision()`` and ``CPUOffload()`` when none was given, as torch
stores them), ``params`` the unit's flat parameter in a list (empty for a unit without
parameters of its own), ``training_state`` torch's ``TrainingState`` (FORWARD_BACKWARD
during a unit's forward and from its pre-backward to the end of the root's backward,
SUMMON_FULL_PARAMS inside ``summon_full_params``, else IDLE). Setting one raises (``AttributeError``): flatshard's
configuration is fixed at wrap time; pass the value to the constructor instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp._common_utils import HandleTrainingState
from torch.distributed.fsdp._common_utils import TrainingState as TorchTrainingState

from flatshard import _C
from flatshard._state import TrainingState
from flatshard.api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy

if TYPE_CHECKING:
    from flatshard._state import UnitState

_IN_STEP = (TrainingState.FORWARD, TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD)
_HANDLE_STATES = {
    TrainingState.IDLE: HandleTrainingState.IDLE,
    TrainingState.FORWARD: HandleTrainingState.FORWARD,
    TrainingState.PRE_BACKWARD: HandleTrainingState.BACKWARD_PRE,
    TrainingState.POST_BACKWARD: HandleTrainingState.BACKWARD_POST,
    TrainingState.SUMMONING: HandleTrainingState.SUMMON_FULL_PARAMS,
}


class TorchAttributes:
    """torch FSDP1's public attributes of a unit (see [Note: torch's attributes])."""

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        return self._unit_state.config.sharding_strategy

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The shard group (torch: the group the unit's parameters are sharded over)."""
        return self._unit_state.config.process_group

    @property
    def mixed_precision(self) -> MixedPrecision:
        return self._unit_state.config.mixed_precision or MixedPrecision()

    @property
    def cpu_offload(self) -> CPUOffload:
        return CPUOffload(offload_params=self._unit_state.config.offload_params)

    @property
    def rank(self) -> int:
        return self._unit_state.config.rank

    @property
    def world_size(self) -> int:
        return self._unit_state.config.world_size

    @property
    def compute_device(self) -> torch.device:
        return self._unit_state.device

    @property
    def limit_all_gathers(self) -> bool:
        return self._unit_state.config.limit_all_gathers

    @property
    def forward_prefetch(self) -> bool:
        return self._unit_state.config.forward_prefetch

    @property
    def backward_prefetch(self) -> BackwardPrefetch | None:
        return self._unit_state.config.backward_prefetch

    @property
    def params(self) -> list[nn.Parameter]:
        """The unit's flat parameter, or none (torch: its ``FlatParameter`` s)."""
        flat = self._unit_state.flat_param
        return [] if flat is None else [flat]

    @property
    def training_state(self) -> TorchTrainingState:
        s = self._unit_state
        if s.training_state is TrainingState.SUMMONING:
            return TorchTrainingState.SUMMON_FULL_PARAMS
        if s.training_state in _IN_STEP:  # (between forward and backward: IDLE, as torch's)
            return TorchTrainingState.FORWARD_BACKWARD
        return TorchTrainingState.IDLE

    @training_state.setter
    def training_state(self, value: TorchTrainingState) -> None:
        """Only the reset to IDLE that frameworks do after an aborted step (flatshard drops that step's
        partial state itself at the next forward)."""
        if value != TorchTrainingState.IDLE:
            raise ValueError(f"FullyShardedDataParallel.training_state: only TrainingState.IDLE can be set (a reset), "
                             f"not {value}; flatshard moves a unit through its states itself.")
        if self._unit_state.training_state is not TrainingState.SUMMONING:
            self._unit_state.switch("reset")

    def _assert_state(self, state: TorchTrainingState | list[TorchTrainingState]) -> None:
        """As torch's: raises ValueError unless the unit is in (one of) ``state``."""
        states = [state] if isinstance(state, TorchTrainingState) else list(state)
        if self.training_state not in states:
            raise ValueError(f"expected to be in states {states} but current state is {self.training_state}")

    @property
    def _is_root(self) -> bool | None:
        return self._unit_state.is_root

    @_is_root.setter
    def _is_root(self, value: bool) -> None:
        """verl sets ``_is_root = True`` on a unit around ``FSDP.summon_full_params(unit)`` and back to False, so
        that torch's summon treats it as a root. flatshard's summon works on any unit as it is: the roles
        stay (a unit that is not the root cannot become one by assignment; lazy init decides)."""
        if not isinstance(value, bool):
            raise TypeError(f"FullyShardedDataParallel._is_root: expected a bool but got {value!r}")

    @property
    def _has_params(self) -> bool:
        return self._unit_state.handle is not None

    @property
    def _state_dict_type(self) -> Any:
        """The unit's state dict type, torch's enum (torch's tests and scripts read it after set_state_dict_type)."""
        return self._unit_state.state_dict_type

    @property
    def _use_orig_params(self) -> bool:
        return self._unit_state.config.use_orig_params

    @property
    def _sync_gradients(self) -> bool:
        return self._unit_state.sync_gradients

    @property
    def _handle(self) -> HandleView | None:
        """torch's FlatParamHandle fields (see [Note: The handle]); None without parameters, as torch's."""
        s = self._unit_state
        return None if s.handle is None else HandleView(s)

    @property
    def _all_handles(self) -> list[HandleView]:
        """On the root (after lazy init), every unit's handle under it (verl walks them); else none, as torch's."""
        s = self._unit_state
        if not s.is_root:
            return []
        return [HandleView(u._unit_state) for u in s.root.units if u._unit_state.handle is not None]

    def _unshard(self, async_op: bool = False) -> _Unsharded | None:
        """As torch's (its tests call it): gathers the unit's full parameters now. Collective."""
        handle = self._handle
        if handle is not None:
            handle.unshard()
        return _Unsharded() if async_op else None

    def _wait_unshard_streams_on_current_stream(self) -> None:
        """As torch's; a no-op here (each unit's gather is waited for where it is used)."""


class _Unsharded:
    """What ``_unshard(async_op=True)`` returns: done already."""

    def wait(self) -> None:
        return None


# [Note: The handle]
# torch's FSDP1 keeps a unit's flat parameter in a ``FlatParamHandle`` (``unit._handle``,
# None without parameters), and frameworks reach into it: accelerate reads
# ``_flat_param._fqns`` and, upcasting a low-precision model, replaces the flat
# parameter's ``.data`` and then sets ``_handle._orig_param_dtype``; verl calls
# ``_handle.reshard(True)`` after a no-grad forward. ``HandleView`` answers those with
# torch's names over the unit's state: the setter of ``_orig_param_dtype`` is where a
# replaced shard is taken up (the runtime's buffers and views made again, as after
# ``model.half()``); ``reshard`` frees the unsharded buffer between iterations (a no-op
# when there is none: flatshard reshards every unit after a no-grad forward);
# ``unshard`` gathers the unit's full parameters for its modules until the next reshard.


class HandleView:
    """torch FSDP1's ``FlatParamHandle`` fields, over a unit's state (see [Note: The handle])."""

    __slots__ = ("_state",)

    def __init__(self, state: UnitState) -> None:
        self._state = state

    def __getattr__(self, name: str):
        raise AttributeError(
            f"'FlatParamHandle' has no attribute '{name}': flatshard answers torch's handle fields listed in "
            f"[Note: The handle] ({', '.join(n for n in dir(type(self)) if not n.startswith('__'))}); '{name}' is "
            f"torch FSDP1's internal, which flatshard does not have.")

    @property
    def flat_param(self) -> nn.Parameter:
        """The unit's flat parameter (its local shard), with torch's ``_local_shard`` alias of its data."""
        flat = self._state.flat_param
        local = flat.__dict__.get("_local_shard")
        if local is None or local.data_ptr() != flat.data_ptr() or local.device != flat.device:
            flat._local_shard = flat.data
        return flat

    def flat_param_to(self, *args, **kwargs) -> None:
        """torch's move of the flat parameter (verl's offload to the host and back): the unit's shard moves
        and the runtime follows (see [Note: Shards on the host]). Only a device may be given."""
        from flatshard._host_offload import move_shard

        flat = self._state.flat_param
        target = torch.empty(0, dtype=flat.dtype, device=flat.device).to(*args, **kwargs)
        if target.dtype != flat.dtype:
            raise ValueError(f"FlatParamHandle.flat_param_to: unit '{self._state.label}': only a device can be given; "
                             f"cast the model with .to(dtype) instead.")
        move_shard(self._state, target.device, bool(kwargs.get("non_blocking", False)))

    @property
    def _training_state(self) -> HandleTrainingState:
        return _HANDLE_STATES[self._state.training_state]

    @property
    def _fully_sharded_module(self) -> nn.Module:
        return self._state.wrapped_module

    @property
    def _use_orig_params(self) -> bool:
        return self._state.config.use_orig_params

    @property
    def _offload_params(self) -> bool:
        return self._state.config.offload_params

    @property
    def uses_sharded_strategy(self) -> bool:
        return self._state.config.sharding_strategy != ShardingStrategy.NO_SHARD

    @property
    def rank(self) -> int:
        return self._state.config.rank

    @property
    def world_size(self) -> int:
        return self._state.config.world_size

    @property
    def device(self) -> torch.device:
        return self._state.device

    @property
    def _orig_param_dtype(self) -> torch.dtype:
        return self._state.flat_param.dtype

    @_orig_param_dtype.setter
    def _orig_param_dtype(self, dtype: torch.dtype) -> None:
        s = self._state
        if s.flat_param.dtype != dtype:
            raise ValueError(
                f"FlatParamHandle._orig_param_dtype: unit '{s.label}' holds {s.flat_param.dtype} parameters, not "
                f"{dtype}; cast the flat parameter (its .data) first, or the module with .to({dtype}).")
        if s.shard_dtype != dtype:  # its .data was replaced: the runtime takes the new shard up
            from flatshard._runtime import after_shard_cast

            after_shard_cast(s)

    def reshard(self, free_unsharded_flat_param: bool = True) -> None:
        """Frees the unit's unsharded buffer (between iterations; a no-op when there is none)."""
        from flatshard._runtime import reshard

        s = self._state
        if s.root is None or s.handle.state == _C.ShardedState.SHARDED:
            return
        if s.root.in_iteration:
            raise RuntimeError(
                f"FlatParamHandle.reshard: unit '{s.label}' is in a forward/backward iteration; flatshard reshards "
                f"it itself when its backward is done. Call reshard between iterations.")
        reshard(s)

    def unshard(self) -> None:
        """Gathers the unit's full parameters for its modules (until the next reshard). Collective."""
        from flatshard._runtime import set_views

        s = self._state
        if s.root is None:
            raise RuntimeError(
                f"FlatParamHandle.unshard: unit '{s.label}' has no root yet; run the root's forward first, or "
                f"use FSDP.summon_full_params(model) to see the full parameters.")
        set_views(s, s.root.scheduler.wait_for_unshard(s.handle, None, views=True))


def mark_flat_parameter(s: UnitState) -> None:
    """The class's flat parameter gets torch FSDP1's ``FlatParameter`` fields that frameworks and torch's tests read
    (beside ``_fqns``, set at construction): what it holds (``_num_params``, ``_numels``, ``_shapes``,
    ``_param_infos``) and this rank's part of it (``_shard_param_infos``, ``_unpadded_unsharded_size``,
    ``_padded_unsharded_size``, ``_sharded_size``, ``_shard_numel_padded``), in torch's types, describing
    flatshard's layout (FSDP1's without ``use_orig_params``; with it, torch aligns each parameter and flatshard does
    not, so the offsets are flatshard's own)."""
    from torch.distributed.fsdp._flat_param import ParamInfo, _ShardParamInfo

    flat, layout, handle = s.flat_param, s.handle.layout, s.handle
    first_slot: dict[int, tuple[nn.Module, str]] = {}
    for module, attr, index in s.param_slots:
        first_slot.setdefault(index, (module, attr))
    numels = tuple(layout.numels)
    flat._num_params = len(numels)
    flat._numels = numels
    flat._shapes = tuple(torch.Size(shape) for shape in layout.shapes)
    flat._param_infos = tuple(ParamInfo(first_slot[i][1], first_slot[i][0], s.param_local_names[i].rpartition(".")[0])
                              for i in range(len(numels)))
    rank = handle.rank if not handle.is_replicated else 0
    slices = {i: (in_param, in_shard, n) for i, in_param, in_shard, n in layout.shard_slices(rank)}
    flat._shard_param_infos = tuple(
        _ShardParamInfo(True, slices[i][1], slices[i][2], slices[i][0], slices[i][0] + slices[i][2] - 1)
        if i in slices else _ShardParamInfo(False, None, None, None, None) for i in range(len(numels)))
    flat._unpadded_unsharded_size = torch.Size([layout.unpadded_numel])
    flat._padded_unsharded_size = torch.Size([layout.padded_numel])
    flat._sharded_size = flat.size()
    flat._shard_numel_padded = flat.numel() - sum(n for _, _, n in slices.values())
    # (torch pads a use_orig_params flat parameter to the world size inside it, an entry of its own; flatshard's
    # padding is at the end either way, outside the unpadded size unless use_orig_params: see _full_params.py)
    tail = layout.padded_numel - layout.unpadded_numel if s.config.use_orig_params else 0
    flat._numels_with_padding = numels + ((tail,) if tail else ())
    flat._is_padding_mask = [False] * len(numels) + ([True] if tail else [])
