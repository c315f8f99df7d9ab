"""CP-vs-stock parity runs, executed inside the spawned ranks.

The reference is stock transformers itself: the patches are reverted while it runs, on the same
model instance and the same batch. Then CP runs and every rank compares loss, logits and the
gradients *summed over its CP group* against the reference.
"""

from __future__ import annotations

import torch

from vlmcp_patch.fixtures.compare import gradient_errors, rel_err, summed_over_group
from vlmcp_patch.fixtures.probes import CollectiveProbe

TOL = 1e-5


def _forward_backward(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def real_positions(batch: dict, logits: torch.Tensor) -> torch.Tensor:
    """Logits at real tokens only: padding positions are not computed under CP (they come back as zeros)."""
    mask = batch.get("attention_mask")
    return logits if mask is None else logits * mask[..., None].to(logits.dtype)


def compare(model, batch: dict, cp_size: int) -> dict:
    """Run stock (patches reverted) then CP on `model`; return the worst relative errors and counts."""
    import vlmcp_patch
    from vlmcp_patch.stats import STATS

    no_labels = {k: v for k, v in batch.items() if k != "labels"}
    vlmcp_patch.revert()
    try:
        ref_out, ref_grads = _forward_backward(model, batch)
        with torch.no_grad():
            ref_logits = model(**no_labels).logits
    finally:
        vlmcp_patch.apply()

    vlmcp_patch.enable(cp_size=cp_size)
    STATS.drain()
    try:
        with CollectiveProbe() as probe:
            out, grads = _forward_backward(model, batch)
        exchanges = probe.calls["all_to_all_single"]
        vision_encoded = STATS.vision_patches if STATS.vision_passes else None
        vision = STATS.drain()
        with torch.no_grad():
            full_logits = model(**no_labels).logits
    finally:
        vlmcp_patch.enable(cp_size=1)

    cp = vlmcp_patch.get_cp_group(cp_size)
    per_rank_equal = all(torch.equal(grads.get(n, torch.zeros_like(g)), g) for n, g in ref_grads.items())
    summed = summed_over_group(grads, cp.group)
    missing = sorted(set(ref_grads) - set(summed))
    grad_errs, decay_errs = gradient_errors(summed, ref_grads)
    worst_grad = max(grad_errs, key=grad_errs.get)
    return {
        "loss": float(out.loss.detach()),
        "ref_loss": float(ref_out.loss.detach()),
        "loss_err": rel_err(out.loss, ref_out.loss),
        "logits_with_labels": out.logits is not None,
        "logits_err": rel_err(real_positions(batch, full_logits), real_positions(batch, ref_logits)),
        "logits_shape_ok": tuple(full_logits.shape) == tuple(ref_logits.shape),
        "grad_err": grad_errs[worst_grad],
        "worst_grad": worst_grad,
        "decay_path_grad_err": max(decay_errs.values(), default=0.0),
        "missing_grads": missing,
        "num_params": len(ref_grads),
        "exchanges": exchanges,
        "per_rank_grads_equal_reference": per_rank_equal,
        "vision_patches_per_rank": vision_encoded,
        "vision_imbalance": vision.get("cp_vision_imbalance"),
    }
