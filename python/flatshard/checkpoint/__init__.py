"""flatshard's checkpoint functions: torch's ``torch.distributed.checkpoint.state_dict`` API for
flatshard models, crash-safe DCP saves, and a streaming full-weight export.

    from flatshard.checkpoint import get_state_dict, set_state_dict, save, load, stream_full_weights
"""

from flatshard.checkpoint._atomic import load, save
from flatshard.checkpoint._export import stream_full_weights
from flatshard.checkpoint._state_dict_api import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

__all__ = [
    "StateDictOptions",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "load",
    "save",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
    "stream_full_weights",
]
