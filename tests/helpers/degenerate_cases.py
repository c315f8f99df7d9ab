"""Degenerate batches stock accepts — no labelled token, a row of one token, a row shorter than P, a row that is
its first token and then padding — run inside the spawned ranks: stock at P=1 (the patches reverted), then CP, on
the same model and batch; loss, and every gradient summed over the CP group element by element.

Stock's cross-entropy gives an ignored target a zero gradient whatever the loss's gradient is, so a batch with no
labelled token has a NaN loss and finite, zero gradients: an optimizer step leaves the weights as they were. CP must
give the same, or the next step turns every weight into NaN.
"""

from __future__ import annotations

import math

import torch

from tests.helpers.cases import build_batch
from tests.helpers.ring_cases import EIGHT_HEADS
from vlmcp_patch.fixtures.data import Segment
from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_5_config, tiny_qwen3_vl_config

S = Segment
IGNORE = -100


def _no_labels(batch: dict) -> dict:
    return {**batch, "labels": torch.full_like(batch["labels"], IGNORE)}


# name -> (layout, how the batch is changed)
BATCHES = {
    "no_labelled_token": ([[S(text=17)]], _no_labels),
    "no_labelled_token_with_images": ([[S(text=5), S(image=(32, 24)), S(text=6), S(image=(16, 16)), S(text=3)]],
                                      _no_labels),
    # the Trainer passes the count of targets over the accumulated batch: 0 when none has one
    "no_labelled_token_num_items_0": ([[S(text=17)]], lambda b: {**_no_labels(b), "num_items_in_batch": 0}),
    "one_token": (("padded", [1]), None),
    "shorter_than_p": (("padded", [3]), None),
    "first_token_then_padding": (("padded", [17, 1]), None),
}

# "-8": eight query heads, so P=3 runs one head per rank and a ring of three (U=1, R=3)
FAMILIES = {
    "qwen3_vl": tiny_qwen3_vl_config, "qwen3_5": tiny_qwen3_5_config,
    "qwen3_vl-8": lambda: tiny_qwen3_vl_config(**EIGHT_HEADS), "qwen3_5-8": lambda: tiny_qwen3_5_config(**EIGHT_HEADS),
}


def degenerate_batch(name: str) -> dict:
    layout, change = BATCHES[name]
    batch = build_batch(layout, seed=7)
    return change(batch) if change else batch


def _same_loss(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= 1e-5 * max(abs(b), 1e-30)


def compare_degenerate(model, batch: dict, cp_size: int) -> dict:
    """Stock, then CP, on `model` and `batch`: whether the losses agree (NaN with NaN), the gradients summed over the
    CP group that are not finite, the largest relative error of a gradient (`gradient_errors`, as the parity tests
    measure it), and whether every gradient stock gives as exact zeros is exact zeros under CP too."""
    import vlmcp_patch
    from tests.helpers.parity import _forward_backward
    from vlmcp_patch.fixtures.compare import gradient_errors, summed_over_group
    from vlmcp_patch.fixtures.probes import CollectiveProbe

    vlmcp_patch.revert()
    try:
        ref_out, ref_grads = _forward_backward(model, batch)
    finally:
        vlmcp_patch.apply()
    vlmcp_patch.enable(cp_size=cp_size)
    try:
        with CollectiveProbe() as probe:
            out, grads = _forward_backward(model, batch)
    finally:
        vlmcp_patch.enable(cp_size=1)
    loss, ref_loss = float(out.loss.detach()), float(ref_out.loss.detach())
    summed = summed_over_group(grads, vlmcp_patch.get_cp_group(cp_size).group)
    errors, _ = gradient_errors(summed, ref_grads) if any(g.abs().max() > 0 for g in ref_grads.values()) else ({}, {})
    zeros_kept = all(torch.equal(summed[n], g) for n, g in ref_grads.items() if n in summed and not g.any())
    return {
        "loss": loss, "ref_loss": ref_loss, "same_loss": _same_loss(loss, ref_loss),
        "stock_grads_finite": all(bool(torch.isfinite(g).all()) for g in ref_grads.values()),
        "not_finite": sorted(n for n, g in summed.items() if not torch.isfinite(g).all()),
        "missing": sorted(set(ref_grads) - set(summed)), "grad_err": max(errors.values(), default=0.0),
        "zeros_kept": zeros_kept,
        "exchanges": probe.calls["all_to_all_single"] + probe.calls["batch_isend_irecv"],
    }


def run_degenerate(rank: int, world_size: int, cp_size: int, families: list[str], names: list[str],
                   per_replica: list[str] | None = None) -> dict:
    """`compare_degenerate` of each family and batch; with `per_replica`, the data-parallel replica r runs only the
    batch `per_replica[r]` (replicas with different batches: one with labels, one without)."""
    import vlmcp_patch

    vlmcp_patch.enable(cp_size=cp_size)
    replica = vlmcp_patch.data_parallel_rank()
    vlmcp_patch.enable(cp_size=1)
    results = {}
    for family in families:
        for name in names if per_replica is None else [per_replica[replica]]:
            model = build_model(FAMILIES[family](), seed=1)
            results[f"{family} {name}"] = compare_degenerate(model, degenerate_batch(name), cp_size)
    return results


def run_trl_fused_head(rank: int, world_size: int, cp_size: int) -> dict:
    """TRL's fused LM head (what its trainers score with: `add_fused_lm_head`, patched under CP) on a batch without a
    labelled token and the Trainer's `num_items_in_batch` = 0, against the same head at P=1."""
    from trl.trainer import sft_trainer

    model = build_model(FAMILIES["qwen3_vl"](), seed=1)
    sft_trainer.add_fused_lm_head(model)
    batch = {**degenerate_batch("no_labelled_token_with_images"), "fused_lm_head": True, "num_items_in_batch": 0}
    return {"qwen3_vl trl_fused_head": compare_degenerate(model, batch, cp_size)}
