"""``FSDPModule``: what a module ``fully_shard`` made does afterwards, torch FSDP2's forward hooks and methods over
the flatshard runtime (see [Note: fully_shard] in _fully_shard.py, which makes the module one)."""

from __future__ import annotations

import functools
import sys
import warnings
import weakref
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import UnshardHandle

from flatshard import _backward, _dtensor_params, _fsdp2_config, _host_offload, _orig_params, _runtime
from flatshard._common import is_unit
from flatshard._mixed_precision import cast_floating
from flatshard._state import TrainingState, UnitState
from flatshard._torch_facade import fsdp2_state

def _pre_forward_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    s = module._unit_state
    if s.in_forward_method:  # a forward inside a registered method's call: part of it (see [Note: Forward methods])
        s.nested_forwards += 1
        s.method_ran_forward = True
        return args, kwargs
    stale = s.forward_call
    if stale is not None:  # the last forward ended by a BaseException (KeyboardInterrupt), which skips the hook
        module._unit_state.forward_call = None
        _runtime.end_forward(module, stale[0], None, raised=True)
    try:
        args, kwargs, call = _runtime.begin_forward(module, args, kwargs)
    except BaseException as error:
        _runtime.forward_raised(module, error)
        raise
    # (with the exception being handled where the module is called, if any: see _post_forward_hook)
    module._unit_state.forward_call = (call, sys.exc_info()[1])
    return args, kwargs


def _post_forward_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    s = module._unit_state
    if s.in_forward_method and s.nested_forwards:  # (see _pre_forward_hook)
        s.nested_forwards -= 1
        return output
    started, s.forward_call = s.forward_call, None
    if started is None:  # the pre-forward hook raised: nothing to end
        return output
    call, handled_by_caller = started
    # always_call: when the module raised, this hook runs in _call_impl's handler, with that exception being
    # handled; one the caller was already handling when it called the module (a retry in an except block) is not
    # the module's.
    error = sys.exc_info()[1]
    if error is not None and error is not handled_by_caller:
        _runtime.end_forward(module, call, None, raised=True)
        _runtime.forward_raised(module, error)
        return None
    output = _runtime.end_forward(module, call, output)
    if s.config.output_dtype is not None:  # MixedPrecisionPolicy.output_dtype
        output = cast_floating(s.config.output_dtype, output)
    return output


# Every module fully_shard made a unit, weakly: how unshard() finds a module's root before the first forward.
_UNITS: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _outermost_unit_around(module: nn.Module) -> nn.Module:
    """The fully_shard module around ``module`` (itself included) that no other one contains: the root its runtime
    is set up from."""
    around = [m for m in _UNITS if any(c is module for c in m.modules())]
    return next(m for m in around if not any(o is not m and any(c is m for c in o.modules()) for o in around))


# FSDPModule's methods flatshard does not have yet: each raises NotImplementedError naming itself.
_NOT_YET = ("set_custom_all_gather", "set_custom_reduce_scatter")


@functools.cache
def _warn_staging_buffers(call: str) -> None:
    """Once per process: see [Note: Where torch's staging buffers come from]."""
    warnings.warn(f"FSDPModule.{call}: flatshard's runtime gathers and reduces in buffers of its own, without torch's "
                  f"staging copies, so this allocator setting has no effect (it never changes results).", UserWarning,
                  stacklevel=3)


def _install_all_reduce_hook(module: nn.Module) -> None:
    """The unit's all-reduce hook into its handle, where torch's calls it: after the division where torch divides
    inside its collectives (fp32 and bf16, summing not forced), else before (see [Note: The all-reduce hook])."""
    s = module._unit_state
    if s.handle is None:
        return
    if s.all_reduce_hook is None:
        s.handle.set_all_reduce_hook(None)
        return
    # (The runtime holds a weak reference to the module, the module's state the hook: a hook that refers to the model
    # makes no cycle through C++, which Python's collector could not see.)
    s.handle.set_all_reduce_hook(functools.partial(_run_all_reduce_hook, weakref.ref(module)),
                                 after_postdivide=s.config.divides_in_collectives)


def _run_all_reduce_hook(module: weakref.ref, reduce_output: torch.Tensor) -> None:
    m = module()
    if m is not None and m._unit_state.all_reduce_hook is not None:
        m._unit_state.all_reduce_hook(reduce_output)


def _on_stream(hook: Callable[[torch.Tensor], None], stream: Any) -> Callable[[torch.Tensor], None]:
    """``hook`` run on ``stream`` after what the current stream queued, the current stream then waiting for it."""

    def on_stream(reduce_output: torch.Tensor) -> None:
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            hook(reduce_output)
        torch.cuda.current_stream().wait_stream(stream)

    return on_stream


def _prefetch_states(method: str, modules: list) -> list[UnitState]:
    for m in modules:
        if not is_unit(m) or not m._unit_state.config.dim0_layout:
            raise ValueError(f"FSDPModule.{method}: expects FSDPModules (modules fully_shard was called on) but got "
                             f"{type(m).__name__}")
    return [st for m in modules for st in (m._unit_state, *m._unit_state.apart_units)]


def _not_yet(name: str) -> Callable:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"FSDPModule.{name}: not supported by flatshard's fully_shard yet (see "
                                  f"[Note: fully_shard's coverage]); use torch's fully_shard for it meanwhile.")

    method.__name__ = name
    return method


class FSDPModule(TorchFSDPModule):
    """flatshard's ``FSDPModule``: an instance of torch's, with its methods on flatshard's runtime."""

    _is_flatshard_unit = True  # see _common.is_unit
    _orig_cls_mro_index = 3  # [FSDP<Orig>, this, torch's FSDPModule, Orig, ...] (torch's __new__ reads it)

    def reshard(self) -> None:
        """Frees this module's unsharded parameters (the registered DTensors come back)."""
        for m in self._units(recurse=False):
            s = m._unit_state
            if s.handle is not None and s.root is not None:
                _runtime.reshard(s)

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gathers this module's parameters; flatshard waits at once (with ``async_op``, the handle's
        ``wait()`` has nothing left to wait for). Before any forward, the outermost sharded module around this
        one is set up as the root first (the runtime is the root's; torch's sets up this module's group alone)."""
        if self._unit_state.is_root is None:
            _runtime.lazy_init(_outermost_unit_around(self))
        for m in self._units(recurse=False):
            m._unshard_own()
        return UnshardHandle() if async_op else None

    def _unshard_own(self) -> None:
        s = self._unit_state
        if s.handle is not None:
            # (Unsharded already, its parameters on the modules: None, a forward's views kept, as torch's no-op.)
            views = s.root.scheduler.wait_for_unshard(s.handle, None, views=s.placeholders_set)
            if views is not None and s.root.in_forward_call and torch.is_grad_enabled():
                # Inside the model's forward (another module reading this one's weight: tying across units): views
                # through a use of their own, whose gradients this unit reduces with its own (see [Note:
                # Recomputation] in _runtime.py), as torch's FSDP2 reduces the unsharded parameters' .grad.
                _runtime.hand_out_views(s, views)
            elif views is not None:
                # Until a forward or backward puts its autograd views there: nn.Parameters as torch's (which code
                # that counts the trainable parameters between unshard() and forward reads), over the same memory.
                _runtime.set_views(s, views, parameters=True)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether the units free their parameters after forward from now on, the root included (which, given
        None at ``fully_shard``, keeps them): False for evaluation, True again for training, as torch's."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}")
        for m in self._units(recurse):
            s = m._unit_state
            s.config = _fsdp2_config.with_reshard_after_forward(s.config, reshard_after_forward)
            if s.handle is not None:  # (no post-forward group any more: a part kept for one goes)
                s.handle.post_forward_group_index = -1
                if s.handle.has_post_forward_shard():
                    _runtime.reshard(s)
            if s.root is not None and s.root.guard is not None:  # (the guard hashes each unit's strategy)
                s.root.guard.model_changed()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: gradients accumulate unsharded, unreduced, until a backward with it True (FSDP2's no_sync)."""
        fsdp2_state.refuse_split_backward_caller(self)
        for m in self._units(recurse):
            m._unit_state.sync_gradients = bool(requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False reduce-scatters each backward's gradients but sums them apart instead of all-reducing them
        over the replicas; the next backward with it True all-reduces that sum once, into ``.grad`` (see [Note:
        Reduce-scatter only] in csrc/flatshard/flat_param.h). No effect on a 1-D mesh."""
        for m in self._units(recurse):
            if m._unit_state.handle is not None:
                m._unit_state.handle.requires_all_reduce = bool(requires_all_reduce)

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Any = None) -> None:
        """``hook(reduce_output)`` on each of this module's reduced gradient shards (after the reduce-scatter; with HSDP
        after the replicas' all-reduce), before the post-divide, as torch's: it may change it in place (torchft
        all-reduces it over its replica group). See [Note: The all-reduce hook] in csrc/flatshard/flat_param.h.
        ``stream`` (1-D meshes only, as torch's): the hook runs there, the reduction's stream waiting for it. The
        rows reduced: with frozen parameters, the trainable ones' only, as torch's; the whole shard of a unit whose
        shard group is one rank (W = 1, HSDP over a shard dim of one), and a trainable parameter no rank gave a
        gradient to as zeros (torch's leaves both out)."""
        s = self._unit_state
        if s.apart_units:  # (torch's error and phrase: see [Note: Parameters on a mesh of their own])
            raise ValueError("set_all_reduce_hook is not supported with multiple param groups")
        if s.config.mesh.ndim > 1 and stream is not None:
            raise ValueError("stream cannot be set when using native HSDP")  # (torch's message)
        if hook is not None and not callable(hook):
            raise ValueError(f"FSDPModule.set_all_reduce_hook: expected a callable hook(reduce_output) but got {hook!r}")
        s.all_reduce_hook = hook if stream is None or hook is None else _on_stream(hook, stream)
        _install_all_reduce_hook(self)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """True: after a backward that reduced a unit's gradients, every trainable parameter of it has a ``.grad``, zeros
        where no rank gave it a gradient, as torch's (for ranks whose forwards use different parameters: mixture of
        experts, multimodal batches). flatshard's reduction always covers every parameter, so the collectives are the
        same either way; what changes is which parameters have a ``.grad``. False (the default, torch's): only the
        parameters this rank's backward gave a gradient to, and the rank guard stops ranks that disagree on which (see
        [Note: Gradients given on some ranks only] in _rank_guard.py)."""
        for m in self._units(recurse):
            m._unit_state.reduce_unused = bool(reduce_scatter_unused_params)

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """How many gradient reduce-scatters may be in flight at once (torchtitan sets 2 on MoE routers), as torch's:
        with 1 (the default) a unit's post-backward first completes the previous unit's reduce-scatter; with N, the
        one N units back, so that backward compute does not wait for an exposed reduce-scatter, at the cost of the
        inputs held meanwhile. The root's scheduler takes the largest any of its units asks for (torch's takes the
        largest of its groups'), from this call on (see [Note: Reductions in flight] in csrc/flatshard/scheduler.h)."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):  # (True is not 1, as torch's)
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        for m in self._units(recurse):
            m._unit_state.reduce_scatters_in_flight = max_input_buffers
        root = self._unit_state.root
        if root is not None:
            _runtime.set_reductions_in_flight(root)

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """True: the gradients' reduce-scatters run over a process group of their own (the same ranks as the shard
        group's, made here with ``dist.new_group(..., use_local_synchronization=True)``, one per set of ranks and
        reused by a later call), so that they can progress while the next all-gathers do, on backends that run one
        collective at a time per group (NCCL); False: over the shard group again. As torch's, a collective call:
        every rank of those groups makes it, in the same order."""
        import torch.distributed as dist

        made: dict[tuple[int, ...], Any] = {}
        for m in self._units(recurse):
            s = m._unit_state
            if s.handle is None:  # (nothing to reduce: no group made for it, as torch's)
                continue
            if not enable:
                s.reduce_scatter_group = None
            else:
                ranks = tuple(dist.get_process_group_ranks(s.config.process_group))
                if list(ranks) != sorted(ranks):  # new_group numbers its ranks in increasing order: shards would move
                    raise NotImplementedError(
                        f"FSDPModule.set_separate_reduce_scatter_group: the shard group of '{s.label}' numbers its "
                        f"ranks {list(ranks)}, not in increasing order, which a group of their own would renumber; "
                        f"flatshard does not support that yet: leave the reduce-scatters on the shard group.")
                if ranks not in made:
                    made[ranks] = s.reduce_scatter_group if s.reduce_scatter_group is not None else dist.new_group(
                        list(ranks), use_local_synchronization=True, group_desc="fsdp_reduce_scatter")
                s.reduce_scatter_group = made[ranks]
            if s.root is not None:
                _runtime.assign_groups(s.root, s)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False: the parameters stay unsharded after backward, so that the next forward gathers nothing
        (gradient accumulation, trading memory for the all-gathers); a forward that reshards, or a backward with
        it True again, frees them. The sharded parameters are not written back to while they are held: step the
        optimizer after a backward with it True, as torch's."""
        for m in self._units(recurse):
            m._unit_state.reshards_after_backward = bool(reshard_after_backward)

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """In this module's pre-forward, after its own all-gather, those modules' all-gathers are issued (instead
        of the runtime's own prefetch), as torch's."""
        self._unit_state.forward_prefetch_to = _prefetch_states("set_modules_to_forward_prefetch", modules)

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """In this module's pre-backward, after its own all-gather, those modules' all-gathers are issued (instead
        of the runtime's implicit one: the unit that ran before it in forward), as torch's."""
        self._unit_state.backward_prefetch_to = _prefetch_states("set_modules_to_backward_prefetch", modules)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """This module's gradients divided by ``factor`` instead of the data-parallel world size (see
        ``_fsdp2_config.divide_factors``)."""
        self._set_divide_factors(float(factor), self._unit_state.config.force_sum_reduction)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """torch's deprecated name of ``set_gradient_divide_factor``."""
        warnings.warn("Use `set_gradient_divide_factor` instead", FutureWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """The reductions only ever SUM, the divisions done apart (see ``_fsdp2_config.divide_factors``)."""
        self._set_divide_factors(self._unit_state.config.gradient_divide_factor, bool(enable))

    def _set_divide_factors(self, factor: float | None, force_sum: bool) -> None:
        for m in self._units(recurse=False):
            m._set_own_divide_factors(factor, force_sum)

    def _set_own_divide_factors(self, factor: float | None, force_sum: bool) -> None:
        s = self._unit_state
        s.config = _fsdp2_config.with_divide_factors(s.config, factor, force_sum,
                                                     s.flat_param.dtype if s.handle is not None else None)
        if s.handle is not None:
            s.handle.set_divide_factors(s.config.predivide, s.config.postdivide)
        _install_all_reduce_hook(self)  # (where it sees the shard follows where torch's divides)
        if s.root is not None and s.root.guard is not None:  # (the guard hashes each unit's configuration)
            s.root.guard.model_changed()

    def set_post_optim_event(self, event: torch.Event) -> None:
        """The next all-gathers wait for ``event`` (recorded after the optimizer step): flatshard makes the current
        stream wait for it now, and every all-gather waits for the current stream (torch's waits its all-gather
        stream alone, which spares compute queued after the step; the order is the same)."""
        event.wait()

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """A hint that this module's parameters are not needed in backward (an embedding's): flatshard still
        gathers them there, which is never wrong, only an all-gather torch's skips."""

    # [Note: Where torch's staging buffers come from]
    # torch's FSDP2 copies each unit's shards into a staging buffer for every all-gather and reduce-scatter, and these
    # two setters choose that buffer's allocator (the process group's own, or NCCL's symmetric memory: zero-copy or
    # copy-engine collectives). They change where bytes sit, never what is computed. flatshard gathers into buffers its
    # scheduler owns, without a copy-in, so neither applies: both are accepted, as the hints they are (torchtitan's
    # ``enable_symm_mem`` calls the second on every module), with one warning per process when one is turned on.
    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Accepted; see [Note: Where torch's staging buffers come from]."""
        if enable:
            _warn_staging_buffers("set_allocate_memory_from_process_group_for_comm(True)")

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Accepted; see [Note: Where torch's staging buffers come from]."""
        _warn_staging_buffers(f"set_symm_mem_for_comm({backend!r})")

    def _units(self, recurse: bool) -> list[nn.Module]:
        """This module's units (itself and every fully_shard module inside it), or itself alone, with the units of its
        parameters on meshes of their own (see [Note: Parameters on a mesh of their own] in _param_meshes.py)."""
        if recurse:
            return [m for m in self.modules() if is_unit(m)]
        return [self, *(apart.wrapped_module for apart in self._unit_state.apart_units)]

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """flatshard ends every backward the same way: nothing to change."""

    def reset_iter_state(self) -> None:
        """After a forward or backward that raised: every unit of this root back to idle and sharded, its
        gradients of the failed iteration dropped (call it on the root)."""
        root = self._unit_state.root
        if root is None:
            return
        if root.final_callback_queued:
            _backward.abort_backward(root)
        for unit in root.units:
            us = unit._unit_state
            us.forward_call = None
            us.in_forward_method, us.nested_forwards = False, 0
            if us.training_state is not TrainingState.IDLE:
                us.switch("reset")
            if us.handle is not None:
                _runtime.reshard(us)
        root.in_iteration = False

    def _apply(self, fn: Callable, recurse: bool = True) -> nn.Module:
        """``to_empty``, ``.to``, ``.float()``, ``.to(torch.float64)``, ``.cpu()``: applied, then every unit's
        parameters put back onto its shard (see [Note: DTensor parameters] in _dtensor_params.py). A cast casts each
        unit's shard (and gradient shard) first, so that the new values land in a shard of the new dtype; a move to
        the host and back moves each unit's shard (see [Note: Shards on the host] in _host_offload.py)."""
        units = [m._unit_state for m in (self.modules() if recurse else [self])
                 if is_unit(m) and m._unit_state.handle is not None and m._unit_state.config.dim0_layout]
        casts, moves = [], []
        for s in units:  # a move elsewhere is refused before anything changes
            shard = s.flat_param.detach()
            probe = fn(shard.new_empty(0))
            if probe.device != shard.device:
                if s.config.offload_params:
                    raise NotImplementedError(
                        f"fully_shard: moving {type(s.wrapped_module).__name__} to {probe.device} after fully_shard: "
                        f"its shards stay in host memory by its CPUOffloadPolicy (they go to {s.device} for each "
                        f"all-gather); leave it where it is.")
                if probe.device != s.device and probe.device.type != "cpu":
                    raise NotImplementedError(
                        f"fully_shard: moving {type(s.wrapped_module).__name__} to {probe.device} after fully_shard: "
                        f"flatshard moves a fully_shard model's shards to the host and back to the device it trains "
                        f"on ({s.device}) only; move the module before fully_shard, or pass the mesh of the device it "
                        f"should train on.")
                moves.append((s, probe.device))
            if probe.dtype != shard.dtype:
                casts.append((s, probe.dtype))
        if moves and self._unit_state.is_root is None:  # (set up first, as a forward would, so that the root knows
            _runtime.lazy_init(_outermost_unit_around(self))  # where its shards are: see [Note: Shards on the host])
        _host_offload.move_shards(moves)
        for s, dtype in casts:  # (every refusal before anything changes)
            if (s.root is not None and s.root.in_iteration) or s.handle.has_unsharded_grad():
                raise RuntimeError(f"fully_shard: {type(s.wrapped_module).__name__} cannot be cast to {dtype} during "
                                   f"a forward/backward iteration, nor with gradients accumulated without sync "
                                   f"(set_requires_gradient_sync(False)) and not reduced yet; cast it between steps.")
        for s, dtype in casts:
            if s.root is not None:
                _runtime.reshard(s)
            _orig_params.writeback(s)  # (a zero_grad since the last step included)
            flat = s.flat_param
            with torch.no_grad():
                flat.data = flat.data.to(dtype)
                if flat.grad is not None:
                    flat.grad = flat.grad.to(dtype)
        self.reshard()
        cast = {id(s) for s, _ in casts}
        for s in units:
            # torch's _apply swaps each .grad with what fn made of it (itself, for a no-op .float()), which a weak
            # reference to it refuses: what the user did to the gradients into the gradient shard first, and the
            # weak references of [Note: A gradient set to None is freed] (_orig_params.py) dropped, so that the next
            # backward reads the gradients as the user left them (the cast units': written back above).
            if id(s) not in cast:
                _orig_params.write_back_grads(s)
            s.orig_grads_given = None
        out = super(TorchFSDPModule, self)._apply(fn, recurse)  # (torch's FSDPModule._apply reads torch's state)
        for s in units:
            _dtensor_params.rebind(s)
        for s, _ in casts:
            _runtime.after_shard_cast(s)
        return out

    def __deepcopy__(self, memo: Any) -> Any:
        raise AssertionError("FSDP does not support deepcopy. Please use state dict for serialization.")

    def _get_fsdp_state(self) -> _ForwardMethodHooks:
        """What torch's ``register_fsdp_forward_method`` calls around a registered method (see
        [Note: Forward methods]); torch's other uses of its FSDP state do not apply to a flatshard module."""
        return _ForwardMethodHooks()


# [Note: Forward methods]
# torch's ``register_fsdp_forward_method(module, "generate")`` (TRL and verl register HF ``generate`` this
# way) wraps the method to call ``module._get_fsdp_state()._pre_forward`` before it and ``_post_forward``
# after it, so that code in the method that reads the module's own parameters outside its forward (an
# embedding looked up, a head applied, a ``forward_features`` called in place of ``forward``) sees them
# unsharded, and gets their gradients. flatshard's ``FSDPModule`` answers with the unit's own forward hooks: the
# method's call is one forward of the unit (lazy init, the root's checks, the parameters gathered as views autograd
# tracks, resharded after as a forward would be: a root given None keeps them, as torch's, unless the method ran the
# module's forward, after which torch's reshards them too, as flatshard's does), and the forwards the method runs of
# the module itself are part of that call (``state.in_forward_method``: their hooks pass). A method
# called from inside the module's forward is part of that forward. A method that raises leaves the unit in its
# call, as torch's does: ``reset_iter_state()`` ends it.
class _ForwardMethodHooks:
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        s = module._unit_state
        if s.forward_call is not None or s.in_forward_method:  # inside the module's forward: part of it
            return args, kwargs
        args, kwargs = _pre_forward_hook(module, args, kwargs)
        s.in_forward_method = True
        s.method_ran_forward = False
        return args, kwargs

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        s = module._unit_state
        if not s.in_forward_method or s.nested_forwards:
            return output
        s.in_forward_method = False
        output = _post_forward_hook(module, args, {}, output)
        # (a root given None kept its parameters: after a method that ran the module's forward, torch's reshards them,
        # its inner forward having set the group idle; the views autograd holds are gathered again before backward)
        if s.method_ran_forward and not s.placeholders_set and _runtime.frees_after_forward(s):
            _runtime.reshard(s, after_forward=True)
        return output


for _name in _NOT_YET:
    setattr(FSDPModule, _name, _not_yet(_name))
