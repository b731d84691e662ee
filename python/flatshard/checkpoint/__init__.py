"""flatshard's checkpoint functions: a streaming full-weight export.

    from flatshard.checkpoint import stream_full_weights
"""

from flatshard.checkpoint._export import stream_full_weights

__all__ = ["stream_full_weights"]
