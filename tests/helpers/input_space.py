"""The input space of the supported classes, combination by combination, run in the spawned ranks.

For each supported class, one batch of two rows (one with an image, one text-only; different lengths) is
presented in every combination of: tokens as `input_ids` or `inputs_embeds`; no `attention_mask` (the
padding becomes real tokens), right or left padding, an all-ones mask, a mask with a hole; no positions,
2D positions (cumsum of the mask), the 3D mRoPE positions a script computes itself (`get_rope_index`, as
the official fine-tuning script does), or 4 rows (text + mRoPE); with or without `mm_token_type_ids`.

Each combination runs three ways on the same model: stock transformers (the patches reverted), the
package at P=1 (must be bit-identical to stock, or fail the same way), and CP over the group (must equal
stock — loss, logits at real tokens, every gradient summed over the group — or, where stock accepts the
input but exact CP is impossible, raise; where stock raises, raise too).
"""

from __future__ import annotations

import itertools

import torch

from tests.helpers.outcomes import identical, outcome
from vlmcp_patch.fixtures.compare import gradient_errors, rel_err, summed_over_group
from vlmcp_patch.fixtures.data import Segment as S
from vlmcp_patch.fixtures.data import make_batch
from vlmcp_patch.fixtures.models import TINY_CONFIGS, build_model

CLASSES = TINY_CONFIGS
TOKENS = ("ids", "embeds")
MASKS = ("none", "right", "left", "ones", "holes")
POSITIONS = ("none", "2d", "3d", "4d")
TOKEN_TYPES = ("with", "without")
ROWS = [[S(text=4), S(image=(16, 16)), S(text=5)], [S(text=7)]]


def combinations(name: str) -> list[tuple[str, str, str, str]]:
    multimodal = "ForConditionalGeneration" in name
    types = TOKEN_TYPES if multimodal else ("without",)
    return list(itertools.product(TOKENS, MASKS, POSITIONS, types))


def _base(multimodal: bool) -> dict:
    batch = make_batch(ROWS, seed=4)
    if not multimodal:
        batch = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
        batch["input_ids"] = batch["input_ids"].clamp(max=100)
        batch["labels"] = batch["labels"].clamp(max=100)
    return batch


def _shift_right(batch: dict) -> dict:
    """Left padding: every per-token tensor rolled so each row's tokens end the row."""
    out, lengths = dict(batch), batch["attention_mask"].sum(1)
    for key in ("input_ids", "mm_token_type_ids", "attention_mask", "labels"):
        if key in batch:
            out[key] = torch.stack([row.roll(int(batch[key].shape[1] - n)) for row, n in zip(batch[key], lengths)])
    return out


def _with_mask(batch: dict, kind: str) -> dict:
    if kind == "left":
        batch = _shift_right(batch)
    elif kind == "ones":
        batch = {**batch, "attention_mask": torch.ones_like(batch["attention_mask"])}
    elif kind == "holes":
        batch = {**batch, "attention_mask": batch["attention_mask"].clone(), "labels": batch["labels"].clone()}
        batch["attention_mask"][1, 2] = 0
    mask = batch["attention_mask"].bool()
    labels = batch["labels"].masked_fill(~mask, -100)
    # No padding position may have a target after the shift (stock would score the padding): the token after
    # a padding run is a prompt token without a label.
    after_padding = torch.zeros_like(mask)
    after_padding[:, 1:] = mask[:, 1:] & ~mask[:, :-1]
    batch = {**batch, "labels": labels.masked_fill(after_padding, -100)}
    return {k: v for k, v in batch.items() if k != "attention_mask"} if kind == "none" else batch


def _with_positions(model, batch: dict, kind: str) -> dict:
    mask = batch.get("attention_mask", torch.ones_like(batch["input_ids"]))
    text = (mask.long().cumsum(-1) - 1).clamp(min=0)
    if kind == "none":
        return batch
    if kind == "2d":
        return {**batch, "position_ids": text}
    mrope = text[None].expand(3, -1, -1)
    if "image_grid_thw" in batch:
        mrope, _ = model.model.get_rope_index(batch["input_ids"], mm_token_type_ids=batch["mm_token_type_ids"],
                                              image_grid_thw=batch["image_grid_thw"], attention_mask=mask)
    positions = mrope if kind == "3d" else torch.cat([text[None], mrope])
    return {**batch, "position_ids": positions}


def batch_for(model, multimodal: bool, tokens: str, mask: str, positions: str, types: str) -> dict:
    batch = _with_positions(model, _with_mask(_base(multimodal), mask), positions)
    if types == "without":
        batch.pop("mm_token_type_ids", None)
    if tokens == "embeds":
        batch["inputs_embeds"] = model.get_input_embeddings()(batch.pop("input_ids")).detach()
    return batch


def refused_by_design(name: str, mask: str) -> bool:
    """Inputs stock accepts that cannot run exactly under CP (README: "When it refuses"): Qwen3.5's DeltaNet
    layers run through a hole in the mask as zeros."""
    return name.startswith("Qwen3_5") and mask == "holes"


def _cp_errors(cp, stock, batch: dict, group) -> dict:
    real = batch.get("attention_mask")
    logits = [x if real is None else x * real[..., None].to(x.dtype) for x in (cp[2], stock[2])]
    summed = summed_over_group(cp[3], group)
    grad_errs, _ = gradient_errors(summed, stock[3])
    return {"loss_err": rel_err(cp[1], stock[1]), "logits_err": rel_err(*logits),
            "grad_err": max(grad_errs.values()), "missing_grads": sorted(set(stock[3]) - set(summed))}


def run_input_space(rank: int, world_size: int, names: list[str]) -> dict:
    """{(class, combination): {"stock": ok/error, "p1_identical": bool | None, "cp": ...}} on this rank."""
    import vlmcp_patch

    cp_group = vlmcp_patch.get_cp_group(world_size).group
    results = {}
    for name in names:
        model = build_model(CLASSES[name](), seed=3)
        multimodal = "ForConditionalGeneration" in name
        for index, combo in enumerate(combinations(name)):
            batch = batch_for(model, multimodal, *combo)
            vlmcp_patch.revert()
            stock = outcome(model, batch)
            vlmcp_patch.apply()
            entry = {"stock": stock[0], "stock_error": stock[1] if stock[0] == "error" else None, "p1_identical": None}
            if index % world_size == rank:  # each rank checks the P=1 rule for its share of the combinations
                entry["p1_identical"] = identical(outcome(model, batch), stock)
            vlmcp_patch.enable(cp_size=world_size, gather_logits_with_labels=True)
            try:
                cp = outcome(model, batch)
            finally:
                vlmcp_patch.enable(cp_size=1, gather_logits_with_labels=False)
            entry["cp"] = cp[0] if cp[0] == "error" else "ok"
            entry["cp_error"] = cp[1:] if cp[0] == "error" else None
            if cp[0] == "ok" and stock[0] == "ok":
                entry.update(_cp_errors(cp, stock, batch, cp_group))
            results[(name, combo)] = entry
    return results
