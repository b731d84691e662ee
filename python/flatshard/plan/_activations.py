"""The activation term of a plan: measured from one plain forward and backward on one rank's batch.

[Note: Measuring activations]
What a model's forward saves for its backward depends on the model's code, the batch and the
dtype, not on flatshard: so the plan takes it from a measured step rather than a formula.
``measure_activations(model, loss_fn)`` runs ``loss_fn(model).backward()`` twice on the model
(three times on a CPU: [Note: The autograd graph in host memory]) as it is (unwrapped, on the device it is on; cast to the compute dtype first when one is
given, as mixed precision computes), the first to let once-only allocations happen, and
returns the highest point of the second, above what was held before it, of the bytes that are
not gradients (the plan counts gradients itself, unit by unit as they are reduced): what the
forward saved for the backward, the loss's temporaries and the backward's own. (Not the
peak less all the gradients: a model whose gradients outweigh its activations peaks at the end
of its backward, where the activations are gone.) Both on CUDA and on a CPU the step's allocations come from torch's own records (the
profiler with ``profile_memory``; a CPU backward runs on the calling thread, so every tensor of
the step is seen); a block whose address ends as a parameter's ``.grad`` is a gradient from its
allocation on. The model must fit on one device: for a model that does not, measure a shallower one
of the same width (one and two layers) and extrapolate per layer, as the CLI's ``--batch-size``
does.

[Note: Activations unit by unit]
One number is the worst point of the step; a plan holding all of it at every unit's backward
overstates the peaks of backward, where the loss's and the head's activations are freed first
and each block's as its backward ends (by a tenth for the tests' GPT under the fake group).
``profile_activations`` measures the same step with a mark at each parameter's gradient
(a post-accumulate-grad hook, a profiler range named after the parameter), and keeps, between
consecutive marks, the highest point of the non-gradient bytes. The plan maps each unit to its
parameters' names: a unit's backward spans from its pre-backward (see [Note: A unit's backward in
the profile]) to its own last gradient, and the activations it holds
there are the highest point within that span, beside the unit's gradients made by then (each
counted from its allocation, not its mark: autograd computes a layer's weight gradient, and
with it the kernel's scratch, before it hands the layer's bias gradient to ``.grad``, whose mark
comes first); what comes after the last unit's (the root's
own backward) is held at the root's reduction. Forward holds the highest point before backward
starts. A bare number (``measure_activations``, the CLI's extrapolation) is spread evenly instead.

[Note: A unit's backward in the profile]
What sets a language model's peak is the loss and the head: a vocabulary of 128k tokens beside a width of
4096 makes the logits and their gradient larger than a decoder layer's buffers. Where those run in
backward decides what is held beside them, so the plan follows the profiled step, not the module tree:
- units run in the order the profile's gradients say (``run_order``: the reverse of the order their last
  gradients are made), not the order they were registered in (a head registered before the layers runs last);
- a unit's backward begins at its pre-backward, where the first gradient of its outputs comes in (the profile
  marks it for every module with a hook on its outputs; without the mark, where its first gradient is
  allocated), and ends at its last gradient's mark. What runs between one unit's backward and the next's
  (the loss's backward and the head's, for a root holding the head) is the root's own: a gap, held with the
  next unit gathered (its prefetch) but not its gradients;
- with FULL_SHARD the first unit in backward is gathered at the root's pre-backward: at the start of backward
  when the model computes its loss (its output is the loss), after the loss's backward when the loss is
  computed outside it; before that it is not held (``gaps_ungathered``);
- the root's gradients count from their allocation on (``root_params``: the head's made first, the embedding's
  last), not from the start of backward.
Measured on HF Llama models with a 4096-token vocabulary at 64 wide (tests/scripts/plan_memory_lm_cases.py: tied
and untied, the head registered first, embedding and head in the root or units of their own, the loss inside the
model or outside) under the fake process group at W = 8 and 64: within 4% of the measured peak in every case,
where registration order and the root's gradients counted whole planned up to 1.33x.

[Note: The autograd graph in host memory]
The profiler sees tensors only. Autograd's graph, a node and its saved-variable records per
operation, lives in host memory beside them: nothing on a GPU, but on a CPU, where the host is
the device, the tests' GPT holds 0.2 MB of it at the end of forward (a tenth of its
activations in fp32, a fifth in bf16). So on a CPU the forward is also run once with glibc's
count of bytes in use (``mallinfo2``) read before and after it; the profile keeps that count
over the profiler's at the same point (``host_scale``), and a plan whose device is the host
(``device="cpu"``) scales the tensors' figures of the profile by it (the graph's nodes are freed
with the tensors they saved; not a kernel's scratch, [Note: Kernel scratch on a CPU], which is
host memory already). The profile's own figures, and ``measure_activations``, are the tensors'
(and, measured on a CPU, the kernels' scratch at their calls). Where glibc is not the allocator,
nothing is added.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import sys
from typing import Callable, Sequence

import torch
from torch import nn

from flatshard.plan._kernel_scratch import MARK as SCRATCH_MARK
from flatshard.plan._kernel_scratch import KernelScratch, glibc


@dataclasses.dataclass(frozen=True)
class ActivationProfile:
    """The activation term of one step, as the step frees it (see [Note: Activations unit by unit])."""

    peak: int  # the highest point of the step's non-gradient bytes (``measure_activations``)
    forward: int  # the highest point before backward starts
    grad_order: tuple[str, ...]  # parameter names, in the order their gradients were made
    grad_bytes: tuple[int, ...]  # the size of each of those gradients
    # segments[k]: the highest point between the gradients grad_order[k - 1] and grad_order[k] (k = 0: from the start of
    # backward; k = len(grad_order): to its end)
    segments: tuple[int, ...]
    at_grads: tuple[int, ...]  # the non-gradient bytes held when each of those gradients was made
    backward_start: int = 0  # the non-gradient bytes held when backward starts
    # On a CPU: the host memory a forward holds (autograd's graph included) over its tensors' bytes, else 1
    # (see [Note: The autograd graph in host memory])
    host_scale: float = 1.0
    # segment_steps[k]: segment k cut at each gradient's allocation: per piece (the gradient allocated where it starts,
    # as its index in grad_order, or -1 at the segment's start; then the non-gradient bytes and a kernel's scratch
    # ([Note: Kernel scratch on a CPU]) at the piece's highest point). Autograd computes a layer's gradients before it
    # hands them to .grad one by one: a weight's is allocated in its bias's segment. () in a profile without them
    segment_steps: tuple[tuple[tuple[int, int, int], ...], ...] = ()
    # Where each module's backward began (the first gradient of its output): (its name, the segment, the index of the
    # piece of segment_steps it begins). () in a profile without them
    pre_backward: tuple[tuple[str, int, int], ...] = ()

    def at_units(self, unit_params: Sequence[Sequence[str]], on_host: bool = False,
                 root_params: Sequence[str] = (), unit_names: Sequence[str] | None = None) -> "UnitActivations":
        """Where the activations are held, for units given in forward order by their parameters' names (the root's
        not among them: ``root_params``, whose gradients are counted from their allocation on) and by their modules'
        names (``unit_names``, for where their backward begins; the root's is ""). ``on_host``: the plan's device is the
        host (the graph's bytes count). See [Note: A unit's backward in the profile]."""
        if on_host and self.host_scale != 1.0:
            def scaled(values: Sequence[int]) -> tuple[int, ...]:
                return tuple(int(v * self.host_scale) for v in values)

            return dataclasses.replace(self, forward=int(self.forward * self.host_scale), segments=scaled(self.segments),
                                       at_grads=scaled(self.at_grads), host_scale=1.0,
                                       segment_steps=tuple(tuple((j, int(t * self.host_scale), x) for j, t, x in steps)
                                                           for steps in self.segment_steps),
                                       backward_start=int(self.backward_start * self.host_scale)
                                       ).at_units(unit_params, root_params=root_params, unit_names=unit_names)
        position = {name: k for k, name in enumerate(self.grad_order)}
        # The step's backward as pieces, in time order: (the gradient allocated where the piece begins or -1, the most
        # held in it); a segment's first piece is at seg_first[segment]. Without allocations, a gradient is made at
        # its mark (a piece of the segment's high before it, and one after).
        pieces: list[tuple[int, int]] = []
        seg_first: list[int] = []
        for k, high in enumerate(self.segments):
            seg_first.append(len(pieces))
            if self.segment_steps:
                pieces.extend((j, tensors + scratch) for j, tensors, scratch in self.segment_steps[k])
            else:
                pieces.append((-1, high))
                if k < len(self.grad_order):
                    pieces.append((k, high))
        seg_first.append(len(pieces))
        made_at = {j: e for e, (j, _) in enumerate(pieces) if j >= 0}  # each gradient's allocation
        marked = {name: seg_first[k] + piece for name, k, piece in self.pre_backward}
        roots = {position[name] for name in root_params if name in position}
        n = len(unit_params)
        out = UnitActivations(self.forward, [0] * n, [(0, 0)] * n, [0] * n, 0, root_at_start=[0] * n,
                              root_at_end=[0] * n, gaps=[(0, 0)] * n, gaps_ungathered=[(0, 0)] * n)

        def root_made_before(piece: int) -> int:
            return sum(self.grad_bytes[j] for j in roots if made_at.get(j, 0) < piece)

        def walk(first: int, stop: int, counted: set[int], grads: int) -> tuple[int, int]:
            """The worst (gradients, activations) over pieces ``first``..``stop - 1``, the gradients in ``counted``
            added as they are allocated."""
            worst = (0, 0)
            for j, held in pieces[first:stop]:
                grads += self.grad_bytes[j] if j in counted else 0
                worst = max(worst, (grads, held), key=sum)
            return worst

        cursor = 0  # the first piece no unit's backward has covered
        for i in reversed(range(n)):
            if unit_params[i] and not any(name in position for name in unit_params[i]):
                raise ValueError(
                    f"flatshard.plan: the activation profile has no gradient of the unit holding "
                    f"{unit_params[i][0]!r}: it was measured on a model whose parameters are named otherwise (profile "
                    f"the model you plan, unwrapped and uncompiled)")
            # (a unit whose gradients all came before the units after it in backward order: none of its own here)
            own = {position[name] for name in unit_params[i] if seg_first[position.get(name, -1) + 1] > cursor}
            if not own:
                segment = next((k for k in range(len(self.segments)) if seg_first[k + 1] > cursor),
                               len(self.segments) - 1)
                out.starting[i] = self.at_grads[segment - 1] if segment else self.backward_start
                out.root_at_start[i] = out.root_at_end[i] = root_made_before(cursor)
                out.computing[i] = (0, self.segments[segment])
                out.left[i] = self.segments[segment]
                continue
            # Its backward begins at its pre-backward (the gradient of its output: profiled), else where its first
            # gradient is allocated; what comes before, since the last unit's, is the root's own (the loss's, the
            # head's for a root holding it): a gap.
            first = min(made_at.get(j, seg_first[j]) for j in own)
            begin = max(cursor, min(marked.get(unit_names[i], first), first) if unit_names else first)
            end = max(own)
            stop = seg_first[end + 1]
            # The unit is gathered from the pre-backward before it in backward order (its prefetch); the first one, from
            # the root's (whose output is the loss, when the model computes it: from the start of backward).
            gathered = cursor
            if i == n - 1 and unit_names is not None and "" in marked:
                gathered = min(max(cursor, marked[""]), begin)
            if gathered > cursor:
                out.gaps_ungathered[i] = walk(cursor, gathered, roots, root_made_before(cursor))
            if begin > gathered:
                out.gaps[i] = walk(gathered, begin, roots, root_made_before(gathered))
            out.root_at_start[i] = root_made_before(begin)
            out.starting[i] = pieces[begin][1]
            # (the unit's own gradients and the root's, each from its allocation on)
            out.computing[i] = walk(begin, stop, own | roots,
                                    sum(self.grad_bytes[j] for j in own if made_at.get(j, 0) < begin))
            out.left[i] = self.at_grads[end]
            out.root_at_end[i] = root_made_before(stop)
            cursor = stop
        out.after = max((held for _, held in pieces[cursor:]), default=0)
        return out

    def run_order(self, unit_params: Sequence[Sequence[str]]) -> list[int]:
        """The indices of units (given by their parameters' names, in registration order) in the order their
        forwards run: the reverse of the order their backwards end in (each unit's last gradient). A unit without
        a gradient in the profile (frozen) keeps its place after the unit registered before it."""
        position = {name: k for k, name in enumerate(self.grad_order)}
        keys: list[float] = []
        for names in unit_params:
            seen = [position[name] for name in names if name in position]
            keys.append(max(seen) if seen else (keys[-1] if keys else float("inf")))
        # (a frozen unit shares the key of the unit registered before it, and comes after it)
        return sorted(range(len(unit_params)), key=lambda i: (-keys[i], i))


@dataclasses.dataclass
class UnitActivations:
    """The activation term where a plan's timeline needs it: the most held in forward; per unit (forward order), as
    its backward starts, while it computes (its own gradients and the root's made meanwhile, and the activations, at
    their worst together), and when its last gradient is made; before its backward, since the last unit's, the root's
    own backward's worst (the root's gradients and the activations: ``gaps``); the root's gradients made by the start
    and the end of each unit's backward; and the most held after the last unit's backward (the root's own)."""

    forward: int
    starting: list[int]
    computing: list[tuple[int, int]]
    left: list[int]
    after: int
    root_at_start: list[int]
    root_at_end: list[int]
    gaps: list[tuple[int, int]]
    gaps_ungathered: list[tuple[int, int]]  # the part of a gap before the unit is gathered (the first unit's)

    @staticmethod
    def even(total: int, unit_grads: Sequence[int], root_grads: int = 0) -> "UnitActivations":
        """``total`` held through forward, each unit's share freed evenly over its backward, its gradients all made
        at the worst point, the root's from the start of backward (for lack of a measured profile)."""
        n = len(unit_grads)
        return UnitActivations(total, [total * (i + 1) // n for i in range(n)],
                               [(g, total * (2 * i + 1) // (2 * n)) for i, g in enumerate(unit_grads)],
                               [total * i // n for i in range(n)], 0, root_at_start=[root_grads] * n,
                               root_at_end=[root_grads] * n, gaps=[(0, 0)] * n, gaps_ungathered=[(0, 0)] * n)


def measure_activations(model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor], *,
                        dtype: torch.dtype | None = None, kernel_scratch: bool = True) -> int:
    """Bytes a forward and backward of ``model`` holds beyond its parameters and the gradients it makes (see
    [Note: Measuring activations]). ``loss_fn(model)`` returns the loss of one rank's batch. ``dtype``: the
    compute dtype (mixed precision's ``param_dtype``); the model's floating-point parameters are cast to it
    in place. ``kernel_scratch``: on a CPU, count what kernels ``malloc`` beside their tensors ([Note: Kernel
    scratch on a CPU]); False where the CPU only stands in for the GPU the plan is for."""
    return profile_activations(model, loss_fn, dtype=dtype, kernel_scratch=kernel_scratch,
                               where="measure_activations").peak


_GRAD_MARK = "flatshard.plan.grad:"
_PRE_BACKWARD_MARK = "flatshard.plan.pre_backward:"
_BACKWARD_MARK = "flatshard.plan.backward"


def profile_activations(model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor], *,
                        dtype: torch.dtype | None = None, kernel_scratch: bool = True,
                        where: str = "profile_activations") -> ActivationProfile:
    """``measure_activations``, with where the step frees what it holds (see [Note: Activations unit by unit]):
    ``flatshard.plan.plan(..., activation_bytes=profile)`` holds each unit's share where its backward runs."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"flatshard.plan.{where}: model: expected an nn.Module but got {type(model).__name__}")
    if dtype is not None:
        model.to(dtype)
    named = dict(model.named_parameters())
    params = list(named.values())
    if not params:
        raise ValueError(f"flatshard.plan.{where}: the model has no parameters")
    device = params[0].device
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"flatshard.plan.{where}: expected a model on a CPU or a CUDA device but it is on {device}")

    def step() -> None:
        loss = loss_fn(model)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"flatshard.plan.{where}: loss_fn(model) must return the loss, a tensor of one element, "
                            f"but returned {type(loss).__name__}")
        with torch.profiler.record_function(_BACKWARD_MARK):
            loss.backward()

    # On a CPU the first step also measures what kernels hold besides tensors ([Note: Kernel scratch on a CPU]).
    scratch = KernelScratch() if device.type == "cpu" and kernel_scratch else None
    scratch = scratch if scratch is not None and scratch.available else None
    with scratch.measuring() if scratch is not None else contextlib.nullcontext():
        step()
    model.zero_grad(set_to_none=True)
    host_forward = _host_bytes_of_forward(model, loss_fn) if device.type == "cpu" else None

    def mark(name: str) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            with torch.profiler.record_function(_GRAD_MARK + name):
                pass
        return hook

    handles = [p.register_post_accumulate_grad_hook(mark(name)) for name, p in named.items() if p.requires_grad]
    handles += [m.register_forward_hook(_mark_pre_backward(name)) for name, m in model.named_modules()]
    try:
        def profiled_step() -> None:
            with scratch.marking() if scratch is not None else contextlib.nullcontext():
                step()

        events = _allocations(profiled_step, device)
    finally:
        for handle in handles:
            handle.remove()
    grad_at = {name: p.grad.untyped_storage().data_ptr() for name, p in named.items() if p.grad is not None}
    grads = set(grad_at.values())
    model.zero_grad(set_to_none=True)
    # The last allocation at a gradient's address is that gradient's (autograd hands its result to .grad).
    last_at = {ptr: i for i, (ptr, size, _) in enumerate(events) if size > 0}
    grad_events = {last_at[ptr] for ptr in grads if ptr in last_at}
    live: dict[int, int] = {}  # address: bytes, of the step's allocations other than gradients
    current = peak = forward = high = forward_end = 0
    in_backward = False
    order: list[str] = []
    segments: list[int] = []
    at_grads: list[int] = []
    steps: list[tuple[tuple[int, int, int], ...]] = []  # see ActivationProfile.segment_steps (addresses, for now)
    pre_backward: dict[str, tuple[int, int]] = {}
    pieces: list[tuple[int, int, int]] = []  # this segment's, closed
    piece = (0, 0, 0)  # this segment's open piece: (gradient's address or 0, non-gradient bytes, scratch) at its worst

    def higher(a: tuple[int, int, int], tensors: int, scratch: int = 0) -> tuple[int, int, int]:
        return a if a[1] + a[2] >= tensors + scratch else (a[0], tensors, scratch)

    for i, (ptr, size, name) in enumerate(events):
        if name == _BACKWARD_MARK:
            in_backward, high, forward_end = True, current, current
            piece = (0, current, 0)
        elif name is not None and name.startswith(_PRE_BACKWARD_MARK):  # a piece of its own begins
            pieces.append(piece)
            piece = (0, current, 0)
            pre_backward.setdefault(name[len(_PRE_BACKWARD_MARK):], (len(segments), len(pieces)))
        elif name is not None and name.startswith(SCRATCH_MARK):  # a kernel's own memory, for its call
            scratch = int(name[len(SCRATCH_MARK):])
            peak = max(peak, current + scratch)
            piece = higher(piece, current, scratch)
            if not in_backward:
                forward = max(forward, current + scratch)
        elif name is not None:
            order.append(name.removeprefix(_GRAD_MARK))
            segments.append(high)
            steps.append((*pieces, piece))
            at_grads.append(current)
            high, pieces, piece = current, [], (0, current, 0)
        elif size > 0 and i in grad_events:
            pieces.append(piece)
            piece = (ptr, current, 0)
        elif size > 0:
            live[ptr] = size
            current += size
            peak = max(peak, current)
            high = max(high, current)
            piece = higher(piece, current)
            if not in_backward:
                forward = max(forward, current)
        elif size < 0:
            current -= live.pop(ptr, 0)  # (what was allocated before the step is not counted)
    segments.append(high)
    steps.append((*pieces, piece))
    index = {grad_at[n]: k for k, n in enumerate(order) if n in grad_at}
    return ActivationProfile(peak=peak, forward=forward, grad_order=tuple(order),
                             grad_bytes=tuple(named[n].numel() * named[n].element_size() for n in order),
                             segments=tuple(segments), at_grads=tuple(at_grads), backward_start=forward_end,
                             segment_steps=tuple(tuple((index.get(ptr, -1) if ptr else -1, t, x) for ptr, t, x in seg)
                                                 for seg in steps),
                             host_scale=max(1.0, host_forward / forward_end) if host_forward and forward_end else 1.0,
                             pre_backward=tuple((name, k, piece) for name, (k, piece) in pre_backward.items()))


def _mark_pre_backward(name: str) -> Callable[..., None]:
    """A forward hook on module ``name`` marking where the first gradient of its outputs comes in backward: where a
    unit's pre-backward would gather it (see [Note: A unit's backward in the profile])."""
    def hook(_module: nn.Module, _args: tuple, output: object) -> None:
        tensors = [t for t in _tensors_in(output) if t.requires_grad]
        if not tensors or not torch.is_grad_enabled():
            return
        fired = []

        def mark(_grad: torch.Tensor) -> None:
            if not fired:
                fired.append(True)
                with torch.profiler.record_function(_PRE_BACKWARD_MARK + name):
                    pass

        for t in tensors:
            t.register_hook(mark)
    return hook


def _tensors_in(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v)]
    if isinstance(value, dict):  # (HF's ModelOutput is one)
        return [t for v in value.values() for t in _tensors_in(v)]
    return []


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                       "fsmblks", "uordblks", "fordblks", "keepcost")]


def _host_bytes_in_use() -> int | None:
    """glibc's count of the bytes malloc has handed out and not had back (None without glibc's ``mallinfo2``)."""
    libc = glibc()
    mallinfo2 = getattr(libc, "mallinfo2", None)
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return info.uordblks + info.hblkhd


def _host_bytes_of_forward(model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor]) -> int | None:
    """What a forward holds in host memory at its end, the autograd graph included (glibc's count; None without it)."""
    before = _host_bytes_in_use()
    if before is None:
        return None
    loss = loss_fn(model)
    after = _host_bytes_in_use()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return max(0, (after or 0) - before)


def _allocations(step: Callable[[], None], device: torch.device) -> list[tuple[int, int, str | None]]:
    """(address, bytes: negative when freed, None) of every allocation and free of ``device``'s memory within
    ``step``, and (0, 0, name) where a range of this module's marks begins, in time order (torch's profiler)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, profile_memory=True) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    events = []
    pending = list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        event = pending.pop()
        fields = event.extra_fields
        if event.tag == _EventType.Allocation and fields.device.type == device.type:
            events.append((event.start_time_ns, fields.id, fields.ptr, fields.alloc_size, None))
        elif event.name.startswith((_GRAD_MARK, _BACKWARD_MARK, SCRATCH_MARK, _PRE_BACKWARD_MARK)):
            # (a scratch mark is made after its call's outputs: at the same nanosecond, after them)
            events.append((event.start_time_ns, sys.maxsize if event.name.startswith(SCRATCH_MARK) else -1, 0, 0,
                           event.name))
        pending.extend(event.children)
    events.sort(key=lambda a: (a[0], a[1]))
    return [(ptr, size, name) for _, _, ptr, size, name in events]
