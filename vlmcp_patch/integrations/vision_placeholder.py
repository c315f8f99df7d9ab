"""Matched vision passes across data-parallel replicas: a placeholder pass where a micro-batch has no images.

Data-parallel wrappers need every rank to run the same modules: ZeRO-3 and FSDP2 all-gather each
module's weights when it runs and reduce-scatter its gradients; DDP (without `find_unused_parameters`)
and ZeRO-1/2 reduce gradients in buckets that must match across ranks. A replica whose micro-batch is
text-only skips the vision tower that the others run, and the job hangs or fails — stock transformers
too. Here every forward of a multimodal model first agrees, in one tiny all-reduce over the world, on
which modalities any replica has; a rank missing one runs the stock forward with a placeholder of the
smallest size the tower accepts (one merged token, `forward.vision.placeholder_vision_inputs`). Its
output goes through the stock placement with no placeholder token in the sequence: the scatter places
nothing and the deepstack rows add to no position, so it joins the graph with weight zero — the loss is
unchanged, its gradients are exactly zero, and forward and backward visit the tower at the same points
as on the ranks with real images.

It acts under CP with more than one replica (setting `match_vision_passes`, `VLMCP_MATCH_VISION_PASSES`:
on under CP by default; `1` also at P=1; `0` never), in the forwards of a data-parallel step only
(`replica_step.replica_step`: a wrapper's forward with gradients, or any forward of weights gathered per call): those
every replica runs together, and the only ones whose tower calls a wrapper pairs across replicas. A forward some
replicas run alone (an evaluation on rank 0) runs as it is, with no all-reduce to wait in.

The placeholder's gradients arrive where the real pass's would: under a wrapper that reduces in arrival order every
tower call runs through one recomputed function (`vision_tiles.one_order_required`), so a replica's placeholder
image pass beside another's real one delivers the tower's weights' gradients in the same order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..collectives.communication import communicate
from ..distributed import (
    cp_requested,
    data_parallel_world_size,
    distributed_ready,
    world_group,
)
from ..flags import GENERATING, VISION_PLACEHOLDERS, scoped
from ..forward.arguments import call_arguments
from ..forward.batch import batch_device
from ..forward.vision import placeholder_vision_inputs
from ..patching import Patch
from ..replica_step import replica_step
from ..settings import SETTINGS
from ..sharding import fsdp2_units_within
from ..stats import STATS
from ..supported import FAMILIES

_INPUTS = {"image": ("pixel_values", "image_grid_thw"), "video": ("pixel_values_videos", "video_grid_thw")}


def matching_required(model) -> bool:
    """Whether this forward of the multimodal `model` must keep its vision passes matched across replicas."""
    setting = SETTINGS.match_vision_passes
    if setting is False or not distributed_ready() or data_parallel_world_size() == 1:
        return False
    if GENERATING.get():
        # generate() decodes each rank alone (CP bypassed); only FSDP2 still gathers the tower's weights per module
        # there (ZeRO-3 weights are gathered for the whole generation by TRL, DDP's are local)
        # (generate() runs inside `disabled()`: the configured CP size, not cp_requested())
        return bool(setting or SETTINGS.cp_size > 1) and fsdp2_units_within(model.visual)
    # only where every replica runs this forward (`replica_step`: a wrapper's forward, which reduces or gathers over
    # the replicas): a forward some replicas run alone needs no matching, and its all-reduce would wait forever
    return (bool(setting) or cp_requested()) and replica_step(model) is not None


def missing_modalities(call: dict) -> frozenset:
    """Modalities this rank must run as placeholders so its vision passes match the other replicas': those another
    rank encodes in this forward (pixels given, no encoder output cached by generate() for them) and this one not."""
    encoded = call.get("mm_encoder_outputs") or {}
    here = [call.get(_INPUTS[m][0]) is not None and encoded.get(m) is None for m in _INPUTS]
    anywhere = torch.tensor(here, dtype=torch.int32, device=batch_device(call))
    group = world_group()
    communicate("all-reduce of the modalities each replica encodes", group, anywhere.numel(),
                lambda: dist.all_reduce(anywhere, op=dist.ReduceOp.MAX, group=group))
    return frozenset(m for m, mine, any_rank in zip(_INPUTS, here, anywhere.tolist()) if any_rank and not mine)


def matched_vision_forward(wrapped, instance, args, kwargs):
    if not matching_required(instance):
        return wrapped(*args, **kwargs)
    call = call_arguments(wrapped, args, kwargs)
    missing = missing_modalities(call)
    if not missing:
        return wrapped(**call)
    device = batch_device(call)
    if not any((call.get("mm_encoder_outputs") or {}).values()):
        call.pop("mm_encoder_outputs", None)  # stock takes pixels or encoder outputs, not both
    for modality in missing:
        pixels_key, grid_key = _INPUTS[modality]
        call[pixels_key], call[grid_key] = placeholder_vision_inputs(
            instance.config.vision_config, device, instance.visual.dtype
        )
    STATS.vision_placeholders += len(missing)
    with scoped(VISION_PLACEHOLDERS, missing):
        return wrapped(**call)


def matched_encoding_for_generation(wrapped, instance, args, kwargs):
    """generate() (transformers 5.20+) encodes the prompts' images and videos once, through the multimodal model's
    `get_*_features`, before decoding: a rank without some modality then encodes a placeholder, so that FSDP2's
    weight gathers of the tower match the other ranks' (its result is dropped)."""
    multimodal = getattr(instance, "model", None)
    if not hasattr(multimodal, "visual") or not matching_required(multimodal):
        return wrapped(*args, **kwargs)
    model_kwargs = args[0] if args else kwargs["model_kwargs"]
    missing = missing_modalities({**model_kwargs, "mm_encoder_outputs": None})
    result = wrapped(*args, **kwargs)
    device = next(multimodal.parameters()).device
    for modality in sorted(missing):
        pixels, grid = placeholder_vision_inputs(multimodal.config.vision_config, device, multimodal.visual.dtype)
        getattr(multimodal, f"get_{modality}_features")(pixels, grid)
    STATS.vision_placeholders += len(missing)
    return result


def placeholder_unchecked_mask(wrapped, instance, args, kwargs):
    # The placeholder's features have no tokens in the sequence: skip stock's count check for them; the
    # mask it returns (the sequence's own placeholder tokens: none) places nothing.
    for modality in VISION_PLACEHOLDERS.get():
        kwargs.pop(f"{modality}_features", None)
    return wrapped(*args, **kwargs)


def placeholder_free_positions(wrapped, instance, args, kwargs):
    # mRoPE positions come from the sequence's own images and videos, never the placeholder's grid.
    for modality in VISION_PLACEHOLDERS.get():
        kwargs[_INPUTS[modality][1]] = None
    return wrapped(*args, **kwargs)


def patches() -> list[Patch]:
    out = [
        Patch(
            target="transformers.generation.utils.GenerationMixin._prepare_multimodal_encoder_kwargs_for_generation",
            wrapper=matched_encoding_for_generation,
            reason="generate() encodes the prompts' images before decoding: replicas without them encode a placeholder "
            "where FSDP2 gathers the tower's weights",
            expects=("model_kwargs",),
            since="transformers>=5.20",
        )
    ]
    for family in FAMILIES:
        if family.multimodal_model is None:
            continue
        target = lambda attribute: family.target(family.multimodal_model, attribute)  # noqa: E731
        out += [
            Patch(
                target=target("forward"),
                wrapper=matched_vision_forward,
                reason="data-parallel replicas without images (or videos) run a zero-weight placeholder vision pass "
                "where another replica has them, so weight gathers and gradient reductions stay matched",
                expects=("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"),
                family=family.name,
            ),
            Patch(
                target=target("get_placeholder_mask"),
                wrapper=placeholder_unchecked_mask,
                reason="vision placeholder: its features match no token of the sequence by design",
                expects=("input_ids", "inputs_embeds", "image_features", "video_features"),
                family=family.name,
            ),
            Patch(
                target=target("compute_3d_position_ids"),
                wrapper=placeholder_free_positions,
                reason="vision placeholder: its grid must not enter the mRoPE positions",
                expects=("image_grid_thw", "video_grid_thw"),
                family=family.name,
            ),
        ]
    return out
