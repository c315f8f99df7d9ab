"""The CP forward shared by the Qwen3-VL and Qwen3.5 families.

Two wrappers carry it:

* `cp_top_level_forward` wraps the user-facing forward (`...ForConditionalGeneration`,
  `...ForCausalLM`). It validates the batch and the setup before any compute, creates the
  `CPContext`, lets the stock forward run (vision tower, placement, deepstack and mRoPE on the full
  sequence), then computes the loss over the group or gathers the logits.
* `cp_text_model_forward` wraps the text decoder. Handed the context, it cuts the full-sequence
  inputs down to this rank's slice and runs the stock decoder on it, with the context riding along
  to the attention layers.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from ..attention.heads import kv_replication
from ..collectives import all_gather_small
from ..context import CTX_KWARG, CPContext, bypassed, cp_requested, disabled, take_pending
from ..distributed import SINGLE_RANK, CPGroup, get_cp_group
from ..errors import CPInputError, UnsupportedSetupError
from ..loss import sharded_causal_lm_loss
from ..packing import packed_starts, packed_text_positions, per_sample_mrope, text_positions_of
from ..patching import Patch
from ..settings import SETTINGS, gather_logits_with_labels
from ..stats import STATS
from . import SUPPORTED_CLASSES, batch_device, batch_reference
from .vision_placeholder import placeholders_in

SUPPORTED_ATTENTION = ("sdpa", "flash_attention_2")


def active_cp() -> CPGroup | None:
    """The CP group for this forward, or None when CP is off (size 1 or inside `vlmcp_patch.disabled()`)."""
    if not cp_requested():
        return None
    return get_cp_group()


def unsupported_model_message(what: str) -> str:
    return (
        f"{what} is not supported under CP (VLMCP_CP_SIZE={SETTINGS.cp_size}); CP runs through the top-level "
        f"classes {', '.join(SUPPORTED_CLASSES)}. Use one of those, set VLMCP_CP_SIZE=1, or run this call inside "
        "`with vlmcp_patch.disabled():`."
    )


def call_arguments(wrapped, args, kwargs) -> dict:
    """All arguments of a call as keywords, including those collected by the target's `**kwargs`."""
    sig = inspect.signature(wrapped)
    bound = sig.bind_partial(*args, **kwargs).arguments
    var_kw = next((p.name for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    call = dict(bound)
    if var_kw is not None:
        call.update(call.pop(var_kw, {}))
    return call


# ---------------------------------------------------------------------------------------------
# Checks made before any compute


@dataclass
class Problem:
    """A reason this rank cannot run the batch under CP; raised on every rank of the group."""

    error: type
    message: str


def check_model_config(text_config, cp_size: int) -> None:
    """Raise `UnsupportedSetupError` if a text config cannot run exactly at this CP size."""
    impl = text_config._attn_implementation
    if impl not in SUPPORTED_ATTENTION:
        raise UnsupportedSetupError(
            f"attn_implementation={impl!r} is not supported under CP (VLMCP_CP_SIZE={SETTINGS.cp_size}) or for "
            "packed rows; load the model with attn_implementation='sdpa' or 'flash_attention_2'."
        )
    kv_replication(text_config.num_attention_heads, text_config.num_key_value_heads, cp_size, "softmax attention")
    if getattr(text_config, "linear_num_value_heads", None):
        kv_replication(
            text_config.linear_num_value_heads, text_config.linear_num_key_heads, cp_size, "gated DeltaNet",
            ("value", "key"),
        )


def _check_setup(model, cp: CPGroup, call: dict) -> Problem | None:
    text_config = model.config.get_text_config()
    try:
        check_model_config(text_config, cp.size)
    except UnsupportedSetupError as exc:
        return Problem(UnsupportedSetupError, str(exc))
    if call.get("past_key_values") is not None:
        return Problem(
            UnsupportedSetupError,
            "a past_key_values cache (incremental decoding) cannot be used under CP; run generation inside "
            "`with vlmcp_patch.disabled():` or with VLMCP_CP_SIZE=1.",
        )
    keep = call.get("logits_to_keep", 0)
    if not (isinstance(keep, int) and keep == 0):
        return Problem(
            UnsupportedSetupError,
            "logits_to_keep is not supported under CP (generation uses it); run generation inside "
            "`with vlmcp_patch.disabled():`.",
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


def _check_batch(model, call: dict) -> Problem | None:
    input_ids = call.get("input_ids")
    reference = input_ids if input_ids is not None else call.get("inputs_embeds")
    if reference is None:
        return Problem(CPInputError, "pass input_ids or inputs_embeds")
    mask = call.get("attention_mask")
    if mask is not None:
        if mask.ndim != 2:
            return Problem(CPInputError, "under CP attention_mask must be the 2D (batch, seq) padding mask")
        if bool((mask[:, 1:].long() > mask[:, :-1].long()).any()):
            return Problem(
                CPInputError,
                "attention_mask has left padding (or holes); under CP pad on the right "
                "(tokenizer.padding_side = 'right') or pack samples without padding.",
            )
        positions = call.get("position_ids")
        if positions is not None and positions.ndim == 2 and bool((positions[:, 1:] - positions[:, :-1] != 1).any()):
            return Problem(
                CPInputError,
                "a batch with both attention_mask and restarting position_ids (packed samples) is ambiguous; "
                "pass packed rows without attention_mask, or padded rows without position_ids.",
            )
    config = model.config
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


def _batch_fingerprint(call: dict) -> list[int]:
    input_ids = call.get("input_ids")
    reference = input_ids if input_ids is not None else call.get("inputs_embeds")
    if reference is None:
        return [0, 0, 0]
    checksum = 0
    if input_ids is not None:
        weights = torch.arange(1, input_ids.shape[-1] + 1, device=input_ids.device) % 9973 + 1
        checksum = int((input_ids.long() * weights).sum())
    return [reference.shape[0], reference.shape[1], checksum]


def agree_on_batch(cp: CPGroup, problem: Problem | None, call: dict) -> None:
    """One small all-gather: every rank learns whether any rank failed its checks or got another batch.

    Raising on every rank together is what keeps a bad batch from leaving some ranks waiting in a
    collective that the others never reach.
    """
    if cp.size == 1:
        if problem is not None:
            raise problem.error(problem.message)
        return
    # On the batch's device: NCCL groups take no CPU tensors.
    local = torch.tensor([int(problem is not None), *_batch_fingerprint(call)], dtype=torch.long,
                         device=batch_device(call))
    gathered = all_gather_small(local, cp.group, cp.size)
    if problem is not None:
        raise problem.error(problem.message)
    failed = gathered[:, 0].nonzero().flatten().tolist()
    if failed:
        raise CPInputError(f"CP rank(s) {failed} of this group rejected the batch; see the error on those ranks")
    if not bool((gathered[:, 1:] == gathered[0, 1:]).all()):
        raise CPInputError(
            "the ranks of a CP group received different batches (shape or input_ids differ): every rank of a CP "
            "group must get the same micro-batch; shard data over data-parallel ranks only "
            "(vlmcp_patch.data_parallel_rank() / data_parallel_world_size())."
        )


def _pin_vision_to_sdpa(model) -> None:
    # The vision tower runs un-sharded and bidirectional; sdpa keeps it away from flash-attention entries.
    vision = getattr(model.config, "vision_config", None)
    if vision is not None and vision._attn_implementation != "sdpa":
        vision._attn_implementation = "sdpa"


# ---------------------------------------------------------------------------------------------
# The wrappers and their declarations


def cp_bypassed_generate(wrapped, instance, args, kwargs):
    # Incremental decoding keeps a cache per rank and feeds one token at a time: nothing to split.
    # Each rank generates on its own, exactly as at P=1.
    if not cp_requested():
        return wrapped(*args, **kwargs)
    with disabled():
        return wrapped(*args, **kwargs)


GENERATE_PATCH = Patch(
    target="transformers.generation.utils.GenerationMixin.generate",
    wrapper=cp_bypassed_generate,
    reason="under CP: generation runs with CP bypassed (each rank decodes alone, as at P=1)",
    expects=("inputs", "generation_config"),
)

TOP_LEVEL_PARAMS = ("input_ids", "attention_mask", "position_ids", "past_key_values", "labels", "logits_to_keep")


def family_patches(module_path: str, top_classes: list[str], text_model: str, text_params: tuple) -> list[Patch]:
    """The two patches every family needs: its top-level forward(s) and its text decoder's forward."""
    SUPPORTED_CLASSES.extend(c for c in top_classes if c not in SUPPORTED_CLASSES)
    tops = [
        Patch(
            target=f"{module_path}.{cls}.forward",
            wrapper=cp_top_level_forward,
            reason="under CP: validate before compute, run vision/placement/mRoPE on the full sequence, then the "
            "loss over the group or gathered logits",
            expects=TOP_LEVEL_PARAMS,
        )
        for cls in top_classes
    ]
    text = Patch(
        target=f"{module_path}.{text_model}.forward",
        wrapper=cp_text_model_forward,
        reason="under CP: cut embeddings, mRoPE positions (and visual rows) to this rank's slice and hand the CP "
        "context to the decoder layers",
        expects=text_params,
    )
    return [*tops, text]


def _packed_layout(call: dict) -> tuple[torch.Tensor | None, Problem | None]:
    """Sample starts of a packed row (None for an ordinary batch), or the reason the row is malformed."""
    try:
        starts = packed_starts(call)
    except CPInputError as exc:
        return None, Problem(CPInputError, str(exc))
    multimodal = call.get("image_grid_thw") is not None or call.get("video_grid_thw") is not None
    if starts is not None and multimodal and (call.get("mm_token_type_ids") is None or call.get("input_ids") is None):
        return None, Problem(
            CPInputError, "a packed multimodal row needs input_ids and mm_token_type_ids for per-sample mRoPE"
        )
    return starts, None


def _prepare_packed_row(model, call: dict, starts: torch.Tensor) -> None:
    """Per-sample mRoPE for a packed multimodal row; the layout then travels in the context."""
    if call.get("image_grid_thw") is not None or call.get("video_grid_thw") is not None:
        call["position_ids"] = per_sample_mrope(model.model, call, starts)
    elif call.get("position_ids") is None:
        call["position_ids"] = packed_text_positions(starts)[None]
    for key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
        call.pop(key, None)  # the context carries the boundaries


def enter_cp_forward(model, call: dict) -> CPContext | None:
    """Checks, packed-row preparation and the `CPContext` of one forward of `model` (its arguments in `call`,
    updated in place), or None when the forward runs stock (P=1, not packed).

    The caller runs the stock forward inside `ctx.handed_to_decoder()`: the top-level forward here, TRL's
    fused LM head (which calls the backbone itself) in integrations/trl.py.
    """
    cp = active_cp()
    starts, problem = _packed_layout(call)
    if cp is None:
        if starts is None and problem is None:
            return None  # P=1, not packed: exactly stock
        cp = SINGLE_RANK  # P=1 packed row: same path, no exchanges
    problem = problem or _check_setup(model, cp, call) or _check_batch(model, call)
    agree_on_batch(cp, problem, call)
    _pin_vision_to_sdpa(model)
    if starts is not None:
        _prepare_packed_row(model, call, starts)

    reference = batch_reference(call)
    ctx = CPContext.create(
        cp,
        batch_size=reference.shape[0],
        seq_len=reference.shape[1],
        device=reference.device,
        attention_mask=call.get("attention_mask"),
        text_position_ids=text_positions_of(call.get("position_ids")),
    )
    STATS.record(ctx)
    return ctx


def cp_top_level_forward(wrapped, instance, args, kwargs):
    if bypassed():
        return wrapped(*args, **kwargs)
    call = call_arguments(wrapped, args, kwargs)
    ctx = enter_cp_forward(instance, call)
    if ctx is None:
        with placeholders_in(instance, call):
            return wrapped(**call)
    labels = call.pop("labels", None)
    shift_labels = call.pop("shift_labels", None)
    num_items_in_batch = call.pop("num_items_in_batch", None)
    return_dict = call.pop("return_dict", None)
    with placeholders_in(instance, call), ctx.handed_to_decoder():
        out = wrapped(**call, return_dict=True)

    fields = dict(out)
    if labels is not None or shift_labels is not None:
        fields["loss"] = sharded_causal_lm_loss(
            out.logits,
            ctx,
            vocab_size=instance.config.get_text_config().vocab_size,
            labels=labels,
            shift_labels=shift_labels,
            num_items_in_batch=num_items_in_batch,
        )
        if gather_logits_with_labels():
            fields["logits"] = ctx.gather(out.logits, dim=1)
    else:
        fields["logits"] = ctx.gather(out.logits, dim=1)
    out = type(out)(**fields)
    if return_dict is False:
        return out.to_tuple()
    return out


def _shard_visual_rows(ctx: CPContext, visual_pos_masks, deepstack_visual_embeds):
    """This rank's slice of the visual mask and the deepstack rows of the visual tokens inside it."""
    full = ctx.pad(visual_pos_masks, dim=1, value=False)
    # Row i of a deepstack tensor belongs to the i-th visual token in (batch, seq) order.
    row_of_token = (full.flatten().cumsum(0) - 1).view_as(full)
    local_mask = full[:, ctx.local_slice]
    rows = row_of_token[:, ctx.local_slice][local_mask]
    local_embeds = None
    if deepstack_visual_embeds is not None:
        local_embeds = [embeds[rows.to(embeds.device)] for embeds in deepstack_visual_embeds]
    return local_mask, local_embeds


def cp_text_model_forward(wrapped, instance, args, kwargs):
    ctx = take_pending()
    if ctx is None:
        if active_cp() is not None:
            raise UnsupportedSetupError(unsupported_model_message(type(instance).__name__ + " called directly"))
        return wrapped(*args, **kwargs)
    call = call_arguments(wrapped, args, kwargs)
    embeds = call.pop("inputs_embeds", None)
    input_ids = call.pop("input_ids", None)
    if embeds is None:
        embeds = instance.embed_tokens(input_ids)
    batch, seq = embeds.shape[:2]

    positions = call.pop("position_ids", None)
    if positions is None:
        positions = torch.arange(seq, device=embeds.device).view(1, 1, -1).expand(3, batch, -1)
    elif positions.ndim == 2:
        positions = positions[None].expand(3, -1, -1)
    elif positions.shape[0] == 4:
        positions = positions[1:]
    # Three rows (no text row): the stock decoder then builds no mask of its own on the local slice.
    call["position_ids"] = ctx.shard(positions, dim=-1)
    call["inputs_embeds"] = ctx.shard(embeds, dim=1)
    call["attention_mask"] = None
    call["past_key_values"] = None
    call["use_cache"] = False
    if call.get("visual_pos_masks") is not None:
        call["visual_pos_masks"], call["deepstack_visual_embeds"] = _shard_visual_rows(
            ctx, call["visual_pos_masks"], call.get("deepstack_visual_embeds")
        )
    call[CTX_KWARG] = ctx
    return wrapped(**call)
