"""torch FSDP1's surface as a table ([Note: The member table]): every member of torch's class is provided by
flatshard's, refused with an error naming it, or listed as not needed; a torch release that adds or renames a
member fails here, not silently under the opt-in."""

from __future__ import annotations

import inspect

import pytest
import torch.distributed.fsdp as torch_fsdp

import flatshard
from flatshard._torch_facade import members


def test_member_table_covers_torch_fsdp1_class():
    problems = members.table_problems(torch_fsdp.FullyShardedDataParallel, flatshard.FullyShardedDataParallel)
    assert not problems, "\n".join(problems)


def test_member_table_check_fails_on_a_member_it_does_not_know():
    class NewerTorchFSDP(torch_fsdp.FullyShardedDataParallel):
        def _a_member_of_a_later_release(self):
            pass

    problems = members.table_problems(NewerTorchFSDP, flatshard.FullyShardedDataParallel)
    assert problems == [f"torch's FSDP1 class has '_a_member_of_a_later_release', which flatshard's member table "
                        "(flatshard/_torch_facade/members.py) does not list: provide it in flatshard's class, or list "
                        "it as refused or not needed, with the reason"], problems


def test_opt_in_applies_the_table():
    torch_class = torch_fsdp.FullyShardedDataParallel
    before = dict(vars(torch_class))
    refused = members.refused_names(torch_class)
    assert refused, "the table refuses nothing?"
    flatshard.install_as_torch_fsdp()
    try:
        for name, (what, _) in members.TORCH_MEMBERS.items():
            if what == members.PROVIDED:
                ours = inspect.getattr_static(flatshard.FullyShardedDataParallel, name)
                assert vars(torch_class)[name] is ours, name
            elif what == members.NOT_NEEDED:
                assert name not in vars(torch_class), name
        for name in refused:
            with pytest.raises(NotImplementedError, match=rf"FullyShardedDataParallel\.{name} is torch FSDP1's "
                                                          r"internal, which flatshard does not have"):
                getattr(torch_class, name)(object())
    finally:
        flatshard.uninstall_as_torch_fsdp()
    assert dict(vars(torch_class)) == before
