"""The patches every family declares on top of the shared CP forward."""

from __future__ import annotations

from collections.abc import Callable

from ..forward.arguments import CACHE_KEYWORDS
from ..forward.decoder import text_model_forward
from ..forward.top_level import cp_top_level_forward
from ..forward.vision import cp_vision_forward
from ..patching import Patch
from ..supported import Family

TOP_LEVEL_PARAMS = ("input_ids", "attention_mask", "position_ids", CACHE_KEYWORDS, "labels", "logits_to_keep")


def family_patches(family: Family, text_params: tuple, cut_family_inputs: Callable | None = None) -> list[Patch]:
    """The top-level forward(s), the text decoder forward (with the family's own per-token inputs cut by
    `cut_family_inputs`) and the vision tower forward of `family`."""
    patches = [
        Patch(
            target=family.target(cls, "forward"),
            wrapper=cp_top_level_forward,
            reason="under CP (and for packed rows): check and agree before compute, lay the batch out as one packed "
            "row, run vision / placement / mRoPE on the whole row, then the chunked loss or gathered logits",
            expects=TOP_LEVEL_PARAMS,
        )
        for cls in family.top_level
    ]
    patches.append(
        Patch(
            target=family.target(family.text_model, "forward"),
            wrapper=text_model_forward(cut_family_inputs),
            reason="under CP: cut embeddings, mRoPE positions (and the family's per-token inputs) to this rank's "
            "slice and hand the CP context to the decoder layers",
            expects=text_params,
        )
    )
    if family.vision_model is not None:
        patches.append(
            Patch(
                target=family.target(family.vision_model, "forward"),
                wrapper=cp_vision_forward,
                reason="under CP: each rank encodes its share of the images and video frames; the features are "
                "gathered back in order (vision data parallelism, VLMCP_VISION_DP)",
                expects=("hidden_states", "grid_thw"),
            )
        )
    return patches
