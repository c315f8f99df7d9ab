"""What one forward + backward gave, and whether two such outcomes are the same bit for bit (the P=1 rule)."""

from __future__ import annotations

import torch


def outcome(model, batch: dict) -> tuple:
    """("ok", loss, logits, gradients) of a forward + backward with `batch`, or ("error", type, message)."""
    model.zero_grad(set_to_none=True)
    if hasattr(model, "model") and hasattr(model.model, "rope_deltas"):
        model.model.rope_deltas = None  # stock keeps mRoPE state across calls: start each run from the same one
    try:
        out = model(**batch)
    except Exception as exc:  # noqa: BLE001 - compared with stock's
        return ("error", type(exc).__name__, str(exc))
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return ("ok", out.loss.detach(), out.logits.detach(), grads)


def identical(a: tuple, b: tuple) -> bool:
    """The same error, or the same loss, logits and every gradient bit for bit."""
    if a[0] != b[0]:
        return False
    if a[0] == "error":
        return a[1:] == b[1:]
    return torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]) and a[3].keys() == b[3].keys() and all(
        torch.equal(a[3][n], b[3][n]) for n in a[3])
