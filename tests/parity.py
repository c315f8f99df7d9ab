"""CP-vs-stock parity runs, executed inside the spawned ranks.

The reference is stock transformers itself: the patches are reverted while it runs, on the same
model instance and the same batch. Then CP runs and every rank compares loss, logits and the
gradients *summed over its CP group* against the reference.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| / max |e| (norm-wise relative error of the whole tensor)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


# Gated-DeltaNet parameters whose only gradient source is the decay gate g: A_log, dt_bias and the
# projection in_proj_a feeding g. Their gradient is a sequence sum of the chunked delta rule's decay
# gradient, a difference of large intra-chunk terms: in these tiny random models it can cancel down
# to 1e-6 of the network's gradient scale, so fp32 rounding shows up 100-1000x larger relative to
# their own magnitude (stock itself moves them by ~1e-5 under a mere change of batch shape). Their
# error is measured against the network's gradient scale; tests/test_deltanet_layer.py checks the
# same path per tensor on a well-conditioned layer.
DECAY_PATH = ("linear_attn.A_log", "linear_attn.dt_bias", "linear_attn.in_proj_a.weight")
TOL = 1e-5


def gradient_errors(grads: dict, ref_grads: dict) -> tuple[dict, dict]:
    """(errors asserted against TOL, per-tensor errors of the decay path for the record)."""
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    errors, decay_own = {}, {}
    for name, ref in ref_grads.items():
        if name not in grads:
            continue
        if name.endswith(DECAY_PATH):
            errors[name] = float((grads[name] - ref).abs().max()) / scale
            decay_own[name] = rel_err(grads[name], ref)
        else:
            errors[name] = rel_err(grads[name], ref)
    return errors, decay_own


class ExchangeCounter:
    """Counts all-to-all calls (proof that the sequence/head exchange really ran) and their buffer bytes."""

    def __init__(self):
        self.calls = 0
        self.buffer_bytes = 0  # each rank's send buffers; (P-1)/P of them leave the rank
        self._orig = dist.all_to_all_single

    def __enter__(self):
        def counting(output, input, *args, **kwargs):
            self.calls += 1
            self.buffer_bytes += input.numel() * input.element_size()
            return self._orig(output, input, *args, **kwargs)

        dist.all_to_all_single = counting
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single = self._orig


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


def summed_over_group(grads: dict, group) -> dict:
    """Each rank holds the gradient of its slice; the CP contract is about their sum over the group."""
    summed = {}
    for name, grad in grads.items():
        total = grad.clone()
        if group is not None:
            dist.all_reduce(total, group=group)
        summed[name] = total
    return summed


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
        with ExchangeCounter() as counter:
            out, grads = _forward_backward(model, batch)
        exchanges = counter.calls
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
