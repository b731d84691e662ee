"""What is gathered ahead of its use: the forward and backward prefetch, the small units gathered together with a
prefetched one, and fully_shard's explicit prefetch lists.

The runtime's pre-forward and pre-backward (``_runtime.py``, ``_backward.py``) ask here which unit to prefetch and
which others come along, then issue them; what the scheduler does with them is in csrc/flatshard/scheduler.h ([Note: Small units
gathered together]).
"""

from __future__ import annotations

from typing import Iterable

from flatshard import _C, _runtime
from flatshard._state import RootState, UnitState


def forward(root: RootState, s: UnitState, position: int) -> tuple[_C.FlatParamHandle | None, list[UnitState] | None]:
    """At ``s``'s pre-forward (``position`` in this forward's order), with forward prefetch: the handle to prefetch
    alone after ``s``'s wait, or the group to gather together instead (see [Note: Forward prefetch], [Note: Gathering
    small units together]); (None, None) for nothing to issue."""
    ahead = _forward_target(root, s, position)
    if ahead is None:
        return None, None
    if root.gather_together_bytes and not ahead.replicated:
        order = root.forward_prefetch_order
        group = _gather_group(root, ahead, (order[i] for i in range(position + 2, len(order))), False)
        if group:
            return None, group
    return ahead.handle, None


def backward(root: RootState, order: list[UnitState], index: int
             ) -> tuple[_C.FlatParamHandle | None, list[UnitState] | None]:
    """At a pre-backward, with BACKWARD_PRE: the handle of ``order[index]`` to prefetch alone, or the group to gather
    together from it (see [Note: Gathering small units together]); (None, None) for nothing to issue."""
    ahead = backward_target(order, index)
    if ahead is None or not root.gather_together_bytes:
        return ahead, None
    t = order[index]
    if t in root.gathered_ahead:
        return None, None  # gathered with an earlier prefetch
    if not t.replicated:
        group = _gather_group(root, t, (order[i] for i in range(index - 1, -1, -1)), True)
        if group:
            return None, group
    return ahead, None


# [Note: Forward prefetch]
# A unit's pre-forward, with forward prefetch (the class's forward_prefetch=True; fully_shard on a CPU mesh, see
# [Note: Forward prefetch where the host is the device] in _fsdp2_config.py), issues the all-gather of the unit that
# came next in the order it learned, so that it overlaps this unit's compute. That guess must not hold memory, nor
# differ between ranks:
# - the order is the last training iteration's (a forward with grad): its backward's collectives pair up across
#   ranks, so its forwards ran the same units everywhere; an evaluation or a generate loop (no grad) does not
#   change it, as its forwards may differ between ranks when they gather nothing (units kept unsharded).
# - the guess is made only while this forward follows that order (the unit is where it was), and only for a unit
#   whose modules hold their placeholders (not one the user unsharded, or one running);
# - a prefetched unit whose forward does not come next (the forward left the order: a unit skipped, a shorter
#   generate) is resharded at once, and at the end of the root's forward at the latest.


def _forward_target(root: RootState, s: UnitState, position: int) -> UnitState | None:
    """See [Note: Forward prefetch]: the unit after ``s`` in the learned order, if this forward follows that order up
    to ``s`` and the unit is sharded (None for one gathered ahead already); remembered in ``root.prefetched_ahead``."""
    order = root.forward_prefetch_order
    if position + 1 >= len(order) or order[position] is not s:
        return None
    t = order[position + 1]
    # (Its modules hold the placeholders: sharded, or gathered ahead already and not run; not one the user unsharded,
    # nor one running. Read here, not from the handle: see [Note: One crossing per lifecycle step] in bindings.cpp.)
    if t.handle is None or t.root is not root or not t.placeholders_set:
        return None
    root.prefetched_ahead = t
    return None if t in root.gathered_ahead else t


def drop_unused(root: RootState) -> None:
    """The unit the last forward prefetch gathered did not run next: sharded again, with the units gathered together
    with it (see [Note: Forward prefetch])."""
    t, root.prefetched_ahead = root.prefetched_ahead, None
    ahead = [t] if t is not None and t not in root.gathered_ahead else []
    ahead += root.gathered_ahead
    root.gathered_ahead.clear()
    for u in ahead:
        if u.handle is not None and not u.holds_unsharded:
            _runtime.reshard(u)


# [Note: The orders hold units that gather]
# The forward orders (``pre_forward_order``, ``post_forward_order``) that the prefetches follow hold the units with
# parameters of their own only, as torch's FSDP2's do: a unit without (a parameterless module given its own
# fully_shard, an activation) issues no collective, and a model may run it on some ranks only; in the orders it would
# make the ranks' prefetches differ, and so the collectives they issue (a gathered group of other units, or an
# all-gather issued before a reduce-scatter on one rank and after it on another).


# [Note: Gathering small units together]
# Where a unit's prefetch is issued (the implicit forward and backward prefetch, not the explicit lists), the units
# that will run after it can come along in the same collective: the scheduler's unshard_together (see [Note: Small
# units gathered together] in csrc/flatshard/scheduler.h). The front-end's config says up to how many bytes
# (``gather_together_bytes``: fully_shard's, see [Note: fully_shard gathers small units together] in
# _fsdp2_config.py; 0 for the class). The candidates are the units after the prefetched one in the order they will
# run (the learned forward order; the backward's, the reverse of this forward's), while they are as the prefetched
# one must be (sharded, their modules holding the placeholders; in backward, with a use left to run), hold no
# post-forward shard of their own, are not gathered already, and fit the bytes; the scheduler takes the run of them
# that it can gather together and says how many. A unit that is not sharded where it stands (it ran already and was
# kept unsharded, or is listed twice) is passed over rather than ending the run: a unit kept unsharded may run a
# different number of times on different ranks, and every rank must gather the same groups (see also [Note: The
# orders hold units that gather]). Those are in ``root.gathered_ahead`` until their own pre-forward
# or pre-backward (or a reshard): their prefetch is issued already, so none is issued for them, and a forward that
# leaves the learned order reshards them with the prefetched unit.
_MAX_GATHERED_TOGETHER = 16


def _gather_group(root: RootState, first: UnitState, following: Iterable[UnitState],
                  backward: bool) -> list[UnitState] | None:
    """``first`` (a prefetch's unit) with the units of ``following`` that may come along, or None if none can (see
    [Note: Gathering small units together])."""
    total = first.gather_bytes
    group = [first]
    for u in following:
        if not u.placeholders_set or u in group:  # (run already and kept, or a repeat: nothing to gather, see below)
            continue
        total += u.gather_bytes
        if (total > root.gather_together_bytes or len(group) == _MAX_GATHERED_TOGETHER or u.root is not root
                or u.replicated or u in root.gathered_ahead or u.config.post_forward_group is not None
                or (backward and not _runtime.has_pending_uses(u))):
            break
        group.append(u)
    return group if len(group) > 1 else None


def unshard_group(root: RootState, group: list[UnitState]) -> None:
    """Gathers ``group`` together (see [Note: Gathering small units together]); remembers those that came along."""
    gathered = root.scheduler.unshard_together([u.handle for u in group])
    root.gathered_ahead.update(group[:gathered])


def explicit(root: RootState, units: list[UnitState]) -> None:
    """fully_shard's explicit prefetch (``set_modules_to_forward_prefetch`` / ``..._backward_prefetch``): the
    units' all-gathers issued now, after this unit's own (a no-op for one already gathered)."""
    for t in units:
        if t.handle is not None and t.root is root:
            root.scheduler.unshard(t.handle)


def backward_target(order: list[UnitState], index: int) -> _C.FlatParamHandle | None:
    """The handle of ``order[index]`` if it is sharded (its modules hold the placeholders) and a use of it
    is still to run its backward (see [Note: Pending uses] in _runtime.py)."""
    if not 0 <= index < len(order):
        return None
    s = order[index]
    return s.handle if s.handle is not None and s.placeholders_set and _runtime.has_pending_uses(s) else None
