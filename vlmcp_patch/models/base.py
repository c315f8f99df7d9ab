"""The patches every family declares on top of the shared CP forward."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

from ..forward.arguments import CACHE_KEYWORDS
from ..forward.decoder import text_model_forward
from ..forward.top_level import cp_top_level_forward
from ..forward.unverified import unverified_guard
from ..forward.vision import cp_image_features, cp_video_features, tower_call, tower_forward
from ..offload import offloaded_checkpoint_call
from ..patching import Patch, source_digest
from ..supported import Family
from ..tiles import DENSE_MLP_CLASSES, VISION_MLP_CLASSES, recomputed_norm_forward, tiled_experts_forward, tiled_mlp
from ..vision_tiles import VISION_TOWER_CLASSES

TOP_LEVEL_PARAMS = ("input_ids", "attention_mask", "position_ids", CACHE_KEYWORDS, "labels", "logits_to_keep")


@dataclass(frozen=True)
class ImageFeatures:
    """A family's `get_image_features` as the CP path replaces it: the pinned digests of the upstream source with
    the releases each was checked on, and those whose forward expects the deepstack levels split per item."""

    digests: Mapping[str, str]
    deepstack_per_item: frozenset[str] = frozenset()


def family_patches(family: Family, text_params: tuple, image_features: ImageFeatures | None = None) -> list[Patch]:
    """The top-level forward(s) and the text decoder forward of `family`, and — for a multimodal family — its
    multimodal model's `get_image_features` / `get_video_features` (vision under CP, `forward/vision.py`)."""
    patches = [
        Patch(
            target=family.target(cls, "forward"),
            wrapper=cp_top_level_forward,
            reason="under CP (and for packed rows): check and agree before compute, lay the batch out as one packed "
            "row and cut it to this rank's slice, run the backbone on the slice, then the chunked loss or gathered "
            "logits",
            expects=TOP_LEVEL_PARAMS,
            family=family.name,
            guard=unverified_guard(family.name),
        )
        for cls in family.top_level
    ]
    patches.append(
        Patch(
            target=family.target(family.text_model, "forward"),
            wrapper=text_model_forward,
            reason="under CP: run the decoder layers on this rank's slice, the CP context handed down to them",
            expects=text_params,
            family=family.name,
        )
    )
    if family.multimodal_model is not None and image_features is not None:
        patches += _vision_patches(family, image_features)
    return patches


@dataclass(frozen=True)
class MLPs:
    """A family's token-wise MLP classes, run in sequence tiles under CP (`tiles.py`): the gated MLPs of its decoder
    (dense layers, shared experts), its vision blocks' MLP, and its MoE experts."""

    gated: tuple[str, ...] = ()
    vision: tuple[str, ...] = ()
    experts: tuple[str, ...] = ()


# Each MLP's forward takes one tensor; its name has had these spellings.
MLP_INPUT = ("x", "hidden_state", "hidden_states")
EXPERTS_PARAMS = ("hidden_states", "top_k_index", "top_k_weights")
_TILES_REASON = ("under CP: the MLP runs over sequence tiles of the rank's slice and is recomputed tile by tile in "
                 "backward, each parameter's gradient summed over the tiles and delivered once (VLMCP_MLP_TILE_TOKENS)"
                 ". It calls the stock forward per tile and relies on it being token-wise, which every MLP is: no "
                 "upstream code is mirrored")


def mlp_patches(family: Family, mlps: MLPs) -> list[Patch]:
    """The tiled-MLP patches of `family`'s MLP classes (`tiles.py`)."""
    DENSE_MLP_CLASSES.update(mlps.gated + mlps.vision)
    VISION_MLP_CLASSES.update(mlps.vision)
    dense = [(cls, tiled_mlp(intermediates=4), (MLP_INPUT,)) for cls in mlps.gated]
    dense += [(cls, tiled_mlp(intermediates=2), (MLP_INPUT,)) for cls in mlps.vision]  # fc1, activation
    experts = [(cls, tiled_experts_forward, EXPERTS_PARAMS) for cls in mlps.experts]
    return [
        Patch(target=family.target(cls, "forward"), wrapper=wrapper, reason=_TILES_REASON, expects=expects,
              family=family.name)
        for cls, wrapper, expects in dense + experts
    ]


def norm_patches(family: Family, norms: tuple[str, ...]) -> list[Patch]:
    """The patches that recompute `family`'s decoder RMSNorms in backward under CP (`tiles.recomputed_norm_forward`)."""
    return [
        Patch(
            target=family.target(cls, "forward"),
            wrapper=recomputed_norm_forward,
            reason="under CP: the RMSNorm keeps only its input for backward and is recomputed there in tiles of "
            "rows, not its fp32 copies (VLMCP_RECOMPUTE_NORMS). It calls the stock forward per tile, in forward and "
            "again in backward, and relies on it being row-wise, which every RMSNorm is: no upstream code is mirrored",
            expects=(("hidden_states", "x"),),
            family=family.name,
        )
        for cls in norms
    ]


def offload_patches(family: Family, checkpointed: tuple[str, ...]) -> list[Patch]:
    """The patches that keep the checkpoints of `family`'s decoder layers and vision blocks (transformers'
    `GradientCheckpointingLayer`s) on the host with `VLMCP_OFFLOAD_CHECKPOINTS` (`offload.py`). `__call__`, not
    `forward`: transformers checkpoints the outermost `forward` of the class, and module hooks stay outside."""
    return [
        Patch(
            target=family.target(cls, "__call__"),
            wrapper=offloaded_checkpoint_call,
            reason="with VLMCP_OFFLOAD_CHECKPOINTS: the input gradient checkpointing saves for this layer waits in a "
            "host pool between forward and backward (copies on a side stream, prefetched in backward)",
            family=family.name,
        )
        for cls in checkpointed
    ]


@functools.cache
def _deepstack_per_item(model_class: type, digests: frozenset[str]) -> bool:
    return source_digest(model_class.get_image_features) in digests


def _vision_patches(family: Family, image_features: ImageFeatures) -> list[Patch]:
    def get_image_features(wrapped, instance, args, kwargs):
        per_item = _deepstack_per_item(type(instance), image_features.deepstack_per_item)
        return cp_image_features(wrapped, instance, args, kwargs, deepstack_per_item=per_item)

    towers = []
    if family.vision_model is not None:
        VISION_TOWER_CLASSES.add(family.vision_model)
        towers = [
            Patch(
                target=family.target(family.vision_model, "forward"),
                wrapper=tower_forward,
                reason="under CP: a share's tiles of items run inside one call of the tower (vision_tiles.py, "
                "VLMCP_VISION_TILE_PATCHES), each through the stock forward, recomputed tile by tile in backward (with "
                "CP off, as set: the call's own items, the stock output class returned); a "
                "ZeRO-3 leaf tower's anchor is fed in. It calls the stock forward per tile and relies on the tower "
                "never mixing temporal patch groups: no upstream code is mirrored",
                expects=("hidden_states", "grid_thw"),
                family=family.name,
            ),
            Patch(
                target=family.target(family.vision_model, "__call__"),
                wrapper=tower_call,
                reason="under CP with ZeRO-3: a leaf tower's call gets an empty input that requires a gradient, so "
                "ZeRO-3 reduces and releases its weights after their gradients exist (vision_tiles.py)",
                family=family.name,
            ),
        ]
    return [
        *towers,
        Patch(
            target=family.target(family.multimodal_model, "get_image_features"),
            wrapper=get_image_features,
            reason="under CP: each rank encodes its share of the images and video frames, and each feature goes to "
            "the rank whose slice holds its placeholder token (vision data parallelism, VLMCP_VISION_DP)",
            expects=("pixel_values", "image_grid_thw"),
            mirrors=image_features.digests,
            family=family.name,
        ),
        Patch(
            target=family.target(family.multimodal_model, "get_video_features"),
            wrapper=cp_video_features,
            reason="under CP: get_video_features hands the videos to get_image_features; mark them as videos",
            expects=("pixel_values_videos", "video_grid_thw"),
            family=family.name,
        ),
    ]
