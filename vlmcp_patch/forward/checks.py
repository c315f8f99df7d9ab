"""What cannot run exactly under CP, found before any compute.

Each check returns a `Problem` instead of raising: the ranks of a CP group first agree (one small
collective, `agreement.py`) and then all raise together, so no rank is left waiting in a collective
that the others never reach.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..attention.heads import kv_replication
from ..distributed import CPGroup
from ..errors import CPInputError, UnsupportedSetupError
from ..settings import cp_size
from .arguments import given_cache
from .rows import is_packed_row, ordinary_batch_problem, packed_row_starts

SUPPORTED_ATTENTION = ("sdpa", "flash_attention_2")


@dataclass
class Problem:
    """A reason this rank cannot run the batch under CP; raised on every rank of the group."""

    error: type
    message: str

    def raise_it(self):
        raise self.error(self.message)


def check_model_config(text_config, size: int) -> None:
    """Raise `UnsupportedSetupError` if a text config cannot run exactly at CP size `size`."""
    impl = text_config._attn_implementation
    if impl not in SUPPORTED_ATTENTION:
        raise UnsupportedSetupError(
            f"attn_implementation={impl!r} is not supported under CP (VLMCP_CP_SIZE={cp_size()}) or for "
            "packed rows; load the model with attn_implementation='sdpa' or 'flash_attention_2'."
        )
    kv_replication(text_config.num_attention_heads, text_config.num_key_value_heads, size, "softmax attention")
    if getattr(text_config, "linear_num_value_heads", None):
        kv_replication(
            text_config.linear_num_value_heads, text_config.linear_num_key_heads, size, "gated DeltaNet",
            ("value", "key"),
        )


def setup_problem(model, cp: CPGroup, call: dict) -> Problem | None:
    """The model and the call's options against CP (attention, heads, cache, logits_to_keep, router loss)."""
    text_config = model.config.get_text_config()
    try:
        check_model_config(text_config, cp.size)
    except UnsupportedSetupError as exc:
        return Problem(UnsupportedSetupError, str(exc))
    if given_cache(call) is not None:
        return Problem(
            UnsupportedSetupError,
            "a past_key_values cache (incremental decoding) cannot be used under CP; generate() runs with CP "
            "bypassed by itself, or run the call inside `with vlmcp_patch.disabled():`.",
        )
    keep = call.get("logits_to_keep", 0)
    if not (isinstance(keep, int) and keep == 0):
        return Problem(
            UnsupportedSetupError,
            "logits_to_keep is not supported under CP (generation uses it; generate() bypasses CP by itself); run "
            "the call inside `with vlmcp_patch.disabled():`.",
        )
    router = call.get("output_router_logits")
    if router is None:
        router = getattr(text_config, "output_router_logits", False)
    if router:
        return Problem(
            UnsupportedSetupError,
            "the MoE router auxiliary loss (output_router_logits=True) is not supported under CP yet; "
            "set config.text_config.output_router_logits=False.",
        )
    return None


def _vision_count_problem(config, call: dict) -> Problem | None:
    input_ids = call.get("input_ids")
    for kind, pixels, grid, token in (
        ("image", "pixel_values", "image_grid_thw", "image_token_id"),
        ("video", "pixel_values_videos", "video_grid_thw", "video_token_id"),
    ):
        if call.get(pixels) is None or input_ids is None:
            continue
        if call.get(grid) is None:
            return Problem(CPInputError, f"{pixels} was given without {grid}")
        merge = config.vision_config.spatial_merge_size
        expected = int((call[grid].prod(-1) // merge**2).sum())
        found = int((input_ids == getattr(config, token)).sum())
        if expected != found:
            return Problem(
                CPInputError,
                f"{kind} features and {kind} tokens do not match: {grid} gives {expected} {kind} tokens but "
                f"input_ids holds {found}; build input_ids with the same processor as the {pixels}.",
            )
    return None


def batch_problem(model, call: dict) -> Problem | None:
    """The batch against CP: its layout (packed row or ordinary batch) and its vision inputs."""
    if call.get("input_ids") is None and call.get("inputs_embeds") is None:
        return Problem(CPInputError, "pass input_ids or inputs_embeds")
    if is_packed_row(call):
        try:
            packed_row_starts(call)
        except CPInputError as exc:
            return Problem(CPInputError, str(exc))
    else:
        reason = ordinary_batch_problem(call)
        if reason is not None:
            return Problem(CPInputError, reason)
    if hasattr(model.config, "vision_config"):
        return _vision_count_problem(model.config, call)
    return None
