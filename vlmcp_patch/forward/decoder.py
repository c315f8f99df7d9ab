"""The patched text decoder: it runs on this rank's slice of the row, the CP context riding along."""

from __future__ import annotations

import torch

from ..context import CTX_KWARG, take_for_decoder
from ..distributed import cp_requested
from ..errors import UnsupportedSetupError
from ..settings import cp_size
from ..supported import unsupported_model_message
from .arguments import CACHE_KEYWORDS, call_arguments


def _three_rows(positions: torch.Tensor) -> torch.Tensor:
    """mRoPE position ids (3, batch, seq) of the slice from the text, 3 or 4 rows it was given."""
    if positions.ndim == 2:
        return positions[None].expand(3, -1, -1)
    return positions[1:] if positions.shape[0] == 4 else positions


def decoder_inputs_of_slice(call: dict) -> None:
    """Rewrite the decoder's arguments (in place) for this rank's slice, which its inputs already are
    (`slicing.cut_to_slice`): positions as three mRoPE rows (no text row), so the stock decoder builds no
    attention mask of its own on the slice (the context carries the sample boundaries); no cache under CP."""
    call["position_ids"] = _three_rows(call["position_ids"])
    call["attention_mask"] = None
    for name in CACHE_KEYWORDS:
        call.pop(name, None)
    call["use_cache"] = False


def text_model_forward(wrapped, instance, args, kwargs):
    """The wrapper of a family's text decoder forward.

    Under CP (and for packed rows at P=1) the decoder runs on this rank's slice: its output is that slice
    (1, local, hidden), returned to the backbone and from there to the caller (`top_level.run_backbone`).
    Called outside a CP forward while CP is on, it raises: the whole sequence would silently run on every
    rank.
    """
    ctx = take_for_decoder()
    if ctx is None:
        if cp_requested():
            raise UnsupportedSetupError(unsupported_model_message(f"{type(instance).__name__} called directly",
                                                                  cp_size()))
        return wrapped(*args, **kwargs)
    call = call_arguments(wrapped, args, kwargs)
    decoder_inputs_of_slice(call)
    call[CTX_KWARG] = ctx
    return wrapped(**call)
