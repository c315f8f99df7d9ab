"""The positions of a planned batch (`positions_of`): as the caller gave them; for an ordinary batch without them,
as stock computes them; for a packed row without 3D positions, as stock computes them for each sample alone.
Stock's own errors on the way (e.g. images without `mm_token_type_ids`) propagate: the plan turns them into the
batch's refusal."""

from __future__ import annotations

import inspect
import itertools

import torch

from ..layout import Segment, positions_restarting_at
from .batch import BatchReading

# Who computes the positions: given by the caller; computed as stock computes them for the caller's batch; or, for a
# packed row, the caller's (or restarting) text positions with each sample's mRoPE computed alone.
BY_CALLER, AS_STOCK, PER_SAMPLE = "the caller", "as stock computes them", "per sample"


def positions_of(model, call: dict, reading: BatchReading, packed: bool) -> tuple[torch.Tensor, str]:
    """(position ids (..., batch, seq) on the caller's layout, who computes them) of a batch that passed every
    rule; `packed`: it is a packed row."""
    given = call.get("position_ids")
    if packed and (given is None or given.ndim == 2):
        multimodal = getattr(model, "model", None)
        return per_sample_mrope(multimodal, call, reading.segments, given, reading.device,
                                reading.carries_vision), PER_SAMPLE
    if given is None:
        return stock_positions(model, call, reading.shape, reading.device), AS_STOCK
    return given.expand(*given.shape[:-2], *reading.shape), BY_CALLER


def stock_positions(model, call: dict, shape: tuple[int, int], device) -> torch.Tensor:
    """Position ids (..., batch, seq) of an ordinary batch, as stock computes them: 3D mRoPE from the multimodal
    model's own `compute_3d_position_ids` on the caller's batch (its errors and its `rope_deltas` state included),
    else 0, 1, ... along each row (what the text decoder does without positions)."""
    batch, seq = shape
    multimodal = getattr(model, "model", None)
    if hasattr(multimodal, "compute_3d_position_ids"):
        embeds = call.get("inputs_embeds")
        positions = multimodal.compute_3d_position_ids(
            input_ids=call.get("input_ids"),
            # Stock hands it the embeddings it looked up. 5.2 reads their shape (batch, seq, hidden) for a batch
            # without vision inputs that follows one with them (it adds the `rope_deltas` kept from that one; 5.25 no
            # longer does when given input_ids): a zero-width stand-in of that shape.
            inputs_embeds=embeds if embeds is not None else torch.empty(batch, seq, 0, device=device),
            image_grid_thw=call.get("image_grid_thw"),
            video_grid_thw=call.get("video_grid_thw"),
            attention_mask=call.get("attention_mask"),
            **token_types_for(multimodal.compute_3d_position_ids, call.get("mm_token_type_ids")),
        )
        if positions is not None:
            return positions
    return torch.arange(seq, device=device).expand(batch, seq)


def token_types_for(function, types: torch.Tensor | None) -> dict:
    """`mm_token_type_ids` as a keyword for `function` where it takes them: transformers 5.2's models have none and
    find the images and videos from the placeholder tokens of `input_ids` (the token types the processor makes say
    the same, so a batch's positions are those stock computes either way)."""
    return {"mm_token_type_ids": types} if "mm_token_type_ids" in inspect.signature(function).parameters else {}


def _frames(video_grid_thw: torch.Tensor) -> torch.Tensor:
    """One grid entry per temporal patch group, as get_rope_index walks videos (timestamps separate them)."""
    frames = torch.repeat_interleave(video_grid_thw, video_grid_thw[:, 0], dim=0)
    frames[:, 0] = 1
    return frames


def placeholder_token_types(config, input_ids: torch.Tensor) -> torch.Tensor:
    """The token types (1: image, 2: video, else 0) of a row given without `mm_token_type_ids`, read from its
    placeholder tokens as the releases whose models take no token types find the items (5.2); the processor's types
    say the same."""
    return (input_ids == config.image_token_id).long() + 2 * (input_ids == config.video_token_id).long()


def _mrope_of_samples(multimodal, call: dict, segments: list[Segment]) -> torch.Tensor:
    """(3, 1, S): each sample's 3D mRoPE computed alone by the model's own `get_rope_index`. Without token types
    (where stock took the row without them: `per_sample_mrope`) they are read from the placeholder tokens."""
    input_ids, types = call["input_ids"], call.get("mm_token_type_ids")
    if types is None:
        types = placeholder_token_types(multimodal.config, input_ids)
    images = iter(call["image_grid_thw"]) if call.get("image_grid_thw") is not None else iter(())
    frames = iter(_frames(call["video_grid_thw"])) if call.get("video_grid_thw") is not None else iter(())
    pieces = []
    for a, b in segments:
        runs = [kind for kind, _ in itertools.groupby(types[0, a:b].tolist())]
        sample_images = [next(images) for kind in runs if kind == 1]
        sample_frames = [next(frames) for kind in runs if kind == 2]
        positions, _ = multimodal.get_rope_index(
            input_ids[:, a:b],
            **token_types_for(multimodal.get_rope_index, types[:, a:b]),
            image_grid_thw=torch.stack(sample_images) if sample_images else None,
            video_grid_thw=torch.stack(sample_frames) if sample_frames else None,
        )
        pieces.append(positions)
    return torch.cat(pieces, dim=-1)


def per_sample_mrope(multimodal, call: dict, segments: list[Segment], text: torch.Tensor | None, device,
                     vision: bool) -> torch.Tensor:
    """Position ids of a packed row on `device`: its text positions `text` (1, S) (restarting at every sample when
    not given), then — with images or videos (`vision`) — each sample's 3D mRoPE computed alone: (4, 1, S).
    `multimodal` is the module with `get_rope_index` (None for a text-only model).

    Stock needs `mm_token_type_ids` with `input_ids` for 3D mRoPE and raises its own error without them; with
    embeddings only it has no ids to compute from, and each sample keeps its text positions.
    """
    text = positions_restarting_at(segments).to(device)[None] if text is None else text
    if not vision or multimodal is None or call.get("input_ids") is None:
        return text
    if call.get("mm_token_type_ids") is None:
        multimodal.compute_3d_position_ids(  # raises stock's error: token types are needed for 3D mRoPE
            input_ids=call["input_ids"], inputs_embeds=None, image_grid_thw=call.get("image_grid_thw"),
            video_grid_thw=call.get("video_grid_thw"), **token_types_for(multimodal.compute_3d_position_ids, None),
        )
    mrope = _mrope_of_samples(multimodal, call, segments)
    return torch.cat([text.to(mrope)[None], mrope], dim=0)
