"""TRL under CP: its fused LM head, which every TRL trainer scores tokens with. (Its token counts go through
`gather_for_metrics`, which keeps one copy per CP group: integrations/accelerate.py; the RL trainers' batch
building: integrations/trl_rl.py.)

TRL's trainers score tokens with a fused LM head (`trl.trainer.utils.add_fused_lm_head`): it replaces the
forward of the model instance, and `model(..., labels=..., fused_lm_head=True)` runs the backbone
(`model.model`) itself, past the patched top-level forward, then projects and scores the sequence in
tiles without building the logits. SFT, GRPO, RLOO, DPO and KTO take their losses, log-probabilities,
entropies and metrics from those per-token outputs (the policy's and the reference model's); they never read
`outputs.logits`. Each trainer module imports the function under its own name, so each import is patched.

Under CP that forward is wrapped: the backbone runs as under the top-level forward (checks, vision,
placement and mRoPE on the full sequence, the decoder on this rank's slice); TRL's head scores this
rank's slice against the labels shifted on the full sequence (its `shift_labels` path); the per-token
outputs are gathered over the group, the backward keeping this rank's slice. Every field and the loss are
the P=1 ones, on every rank. At P=1 a packed row takes the same path (per-sample mRoPE and boundaries).

TRL before 1.16's DPOTrainer calls the model with chosen keys of its batch, leaving the record of the host cut of
the pixel values behind (`forward/host_pixels.py`): its forwards take the record from the batch
(`carrying_pixel_records`).
"""

from __future__ import annotations

import functools
import types

import torch

from ..distributed import cp_running
from ..flags import BYPASS, CARRIED_BATCH, FULL_LOGITS, scoped
from ..forward.arguments import call_arguments
from ..forward.top_level import enter_cp_forward
from ..loss import IGNORE_INDEX
from ..patching import Patch

# Digest of trl 1.16's `add_fused_lm_head` (the forward it installs included): the wrapper relies on that
# forward's `shift_labels` path and on its per-token output fields; a different digest needs a re-check (1.15's
# differs: refused). TRL has the fused head from 1.15 on; before, its trainers take logits from the model's forward.
FUSED_LM_HEAD = {"422d009f04b66659": "trl>=1.16,<1.17"}
FUSED_LM_HEAD_SINCE = "trl>=1.15"

# The per-token fields of TRL's `FusedCausalLMOutput`.
PER_TOKEN_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")


def _gathered_to_caller(ctx, x: torch.Tensor) -> torch.Tensor:
    flag = x.dtype == torch.bool
    full = ctx.to_caller(ctx.gather(x.to(torch.uint8) if flag else x, dim=1))
    return full.bool() if flag else full


def _unshard_head(model) -> None:
    """Under FSDP2, gather the LM head's weights the way its own forward would.

    TRL's head reads `lm_head.weight` without calling the module; a sharded weight then goes through
    `DTensor.full_tensor()`, whose backward keeps each rank's own gradient shard unreduced — under CP each
    rank holds only its slice's part. Unsharded here, the weight is a plain tensor and FSDP2 reduce-scatters
    its gradient at the end of backward (its final callback handles groups left unsharded).
    """
    from torch.distributed.fsdp import FSDPModule

    head = model.get_output_embeddings()
    if isinstance(head, FSDPModule):
        head.unshard()


def cp_fused_lm_head_forward(model, fused, args, kwargs):
    """TRL's fused-head forward `fused` of `model` under CP (or on a packed row at P=1)."""
    if not kwargs.get("fused_lm_head") or BYPASS.get():
        return fused(*args, **kwargs)
    call = call_arguments(fused, args, kwargs)
    call.pop("fused_lm_head")
    trl_shifts = call.get("shift_labels") is None  # TRL then scores positions 0..S-2: the P=1 shape
    num_items_in_batch = call.pop("num_items_in_batch", None)
    ctx = enter_cp_forward(model, call)
    if ctx is None:
        return fused(*args, **kwargs)
    full = call.pop("shift_labels", None)
    local = None if full is None else ctx.shard(full, dim=1, value=IGNORE_INDEX)
    _unshard_head(model)
    with ctx.running():  # TRL calls the backbone, whose decoder takes the context
        out = fused(**call, fused_lm_head=True, shift_labels=local)
    fields = {}
    for name in PER_TOKEN_FIELDS:
        x = getattr(out, name)
        if x is not None:
            x = _gathered_to_caller(ctx, x)
            x = x[:, :-1].contiguous() if trl_shifts else x  # a copy, not a view of the gathered tensor
        fields[name] = x
    count = fields["label_mask"].sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    return type(out)(loss=-fields["log_probs"].sum() / count, aux_loss=out.aux_loss, **fields)


def cp_add_fused_lm_head(wrapped, instance, args, kwargs):
    # A plain method, not a proxy: Accelerate's mixed precision rebinds `model.forward.__func__`, which must
    # be this function and not TRL's behind it.
    result = wrapped(*args, **kwargs)
    model = args[0] if args else kwargs["model"]
    fused = model.forward

    @functools.wraps(fused.__func__)  # the signature TRL copies from the class forward (`generate` checks it)
    def forward(self, *a, **kw):
        return cp_fused_lm_head_forward(self, fused, a, kw)

    model.forward = types.MethodType(forward, model)
    return result


def full_logits_for_metrics(wrapped, instance, args, kwargs):
    """TRL < 1.15's SFTTrainer: its loss comes from the model's forward (the CP one), and its entropy and token
    accuracy from `outputs.logits`, which the CP forward builds with labels only on request: ask for them (the full
    sequence's, gathered over the group — what the forward returns at P=1)."""
    with scoped(FULL_LOGITS, cp_running()):
        return wrapped(*args, **kwargs)


def carrying_pixel_records(wrapped, instance, args, kwargs):
    """TRL < 1.16's DPOTrainer builds its model calls (the policy's, the reference's) from chosen keys of `inputs`,
    leaving behind the record of the host cut of the pixel values (`forward/host_pixels.py`): inside, a forward
    whose pixel values are the cut share of `inputs` takes their record. (1.16 passes every key on. In both, the
    vision collator repeats the images for chosen and rejected, before the cut: nothing is concatenated after it.)"""
    with scoped(CARRIED_BATCH, call_arguments(wrapped, args, kwargs).get("inputs")):
        return wrapped(*args, **kwargs)


TRAINERS = ("sft", "grpo", "rloo", "dpo", "kto")


def patches() -> list[Patch]:
    return [
        Patch(
            target=f"trl.trainer.{trainer}_trainer.add_fused_lm_head",
            wrapper=cp_add_fused_lm_head,
            reason="under CP: TRL's fused LM head runs the backbone past the patched top-level forward and scores "
            "the full sequence; run the backbone under CP, score this rank's slice, gather the per-token outputs",
            expects=("model", "outputs"),
            mirrors=FUSED_LM_HEAD,
            requires="trl",
            since=FUSED_LM_HEAD_SINCE,
        )
        for trainer in TRAINERS
    ] + [
        Patch(
            target="trl.trainer.sft_trainer.SFTTrainer.compute_loss",
            wrapper=full_logits_for_metrics,
            reason="TRL < 1.15, under CP: SFTTrainer logs entropy and token accuracy from the forward's logits; the "
            "CP forward returns them with labels on request (gathered, as at P=1)",
            expects=("model", "inputs"),
            requires="trl",
            since="trl<1.15",
        ),
        # its `compute_ref_log_probs` picks keys too, but serves only precomputed references, which 0.29 computes for
        # text-only pairs (with images stock fails): not wrapped
        Patch(
            target="trl.trainer.dpo_trainer.DPOTrainer.compute_loss",
            wrapper=carrying_pixel_records,
            reason="TRL < 1.16, under CP: DPOTrainer calls the model with chosen keys of its batch, leaving the record "
            "of the host cut of the pixel values behind; its forwards take the batch's record",
            expects=("inputs",),
            requires="trl",
            # before 0.29 the DPO trainer's module does not import on transformers 5 (it reaches for mergekit)
            since="trl>=0.29,<1.16",
        ),
    ]
