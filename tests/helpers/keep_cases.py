"""`logits_to_keep` in training forwards under CP against stock at P=1, run inside the spawned ranks.

Each case is a batch (Qwen3-VL with images; two on Qwen3.5) and the call's `logits_to_keep` with the labels stock's
loss pairs with the kept logits: the kept positions' labels (ms-swift cuts them so, `swift_*`), or `shift_labels` of the
kept shape. Stock runs with the patches reverted, on the same model and batch; then CP. Each rank reports the errors of
the loss, of the gradients summed over its group, and of the kept logits (a forward without labels, and with labels in
a tuple), with their shapes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.helpers.cases import MULTI_IMAGE, PACKED_TEXT, PADDED_PAIR, build_batch
from vlmcp_patch.fixtures.compare import gradient_errors, rel_err, summed_over_group
from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_5_config, tiny_qwen3_vl_config

IGNORE = -100


def swift_int(batch: dict) -> dict:
    """ms-swift's several-row form: keep from the earliest label of the batch (one before it) to the end, and the
    labels of those positions."""
    labels = batch["labels"]
    keep = labels.shape[-1] - int((labels != IGNORE).int().argmax(-1).min()) + 1
    return {"logits_to_keep": keep, "labels": labels[:, -keep:]}


def swift_mask(batch: dict) -> dict:
    """ms-swift's one-row form: a boolean mask of the positions whose next label is a target (and the last), with the
    labels of the targets compacted behind one -100 (the first token a prompt's, without a label, as there)."""
    labels = batch["labels"].clone()
    labels[:, 0] = IGNORE
    loss_mask = (labels != IGNORE)[0]
    return {"logits_to_keep": F.pad(loss_mask[1:], (0, 1), value=True),
            "labels": F.pad(labels[:, loss_mask], (1, 0), value=IGNORE)}


def last_labels(keep: int):
    return lambda batch: {"logits_to_keep": keep, "labels": batch["labels"][:, -keep:]}


def targets_for(keep, shape: tuple[int, ...], seed: int = 5, ignored_every: int = 3) -> dict:
    """`shift_labels` of the kept shape: random targets, every `ignored_every`-th ignored."""
    g = torch.Generator().manual_seed(seed)
    targets = torch.randint(1, 120, shape, generator=g)
    targets.view(-1)[ignored_every - 1::ignored_every] = IGNORE
    return {"logits_to_keep": keep, "shift_labels": targets}


def positions(batch: dict) -> dict:
    """A 1D tensor of positions: out of order, one repeated, the first and the last."""
    keep = torch.tensor([30, 0, 7, 30, 54, 12, 29, 28])
    return targets_for(keep, (1, keep.numel()), ignored_every=4)


def positions_per_row(batch: dict) -> dict:
    """A 2D tensor of positions, per row (the shorter row's inside its real tokens)."""
    keep = torch.tensor([[0, 5, 20, 27, 11], [3, 3, 14, 40, 27]])
    return targets_for(keep, tuple(keep.shape))


def mask_per_row(batch: dict) -> dict:
    """A 2D boolean mask: every real token whose next token is a target; the kept logits come flattened."""
    keep = F.pad((batch["labels"] != IGNORE)[:, 1:], (0, 1), value=False)
    return targets_for(keep, (1, int(keep.sum())))


# name -> (layout, the call's `logits_to_keep` and labels from the batch)
CASES = {
    "int_0": (MULTI_IMAGE, lambda b: {"logits_to_keep": 0, "labels": b["labels"]}),
    "int_1": (MULTI_IMAGE, lambda b: targets_for(1, (1, 1))),
    "int_1_ignored": (MULTI_IMAGE, lambda b: targets_for(1, (1, 1), ignored_every=1)),  # no target: NaN, as stock
    "int_inside_a_slice": (MULTI_IMAGE, last_labels(9)),
    "int_across_slices": (MULTI_IMAGE, last_labels(40)),  # more than a rank's slice (55 tokens: 28 at P=2)
    "int_beyond_the_row": (MULTI_IMAGE, lambda b: {"logits_to_keep": 100, "labels": b["labels"]}),
    "swift_int_padded_pair": (PADDED_PAIR, swift_int),  # kept padding of the shorter row
    "swift_mask": (MULTI_IMAGE, swift_mask),
    "positions": (MULTI_IMAGE, positions),
    "positions_per_row": (PADDED_PAIR, positions_per_row),
    "mask_per_row": (PADDED_PAIR, mask_per_row),
    "packed_row": (PACKED_TEXT, last_labels(17)),
    "own_head_inside_a_slice": (MULTI_IMAGE, last_labels(9)),  # the model's own head, not the fused one
    "own_head_positions": (MULTI_IMAGE, positions),
    "qwen3_5_swift_int_padded_pair": (PADDED_PAIR, swift_int),  # Qwen3.5 (DeltaNet layers), the same head path
    "qwen3_5_positions": (MULTI_IMAGE, positions),
    "ring_positions": (MULTI_IMAGE, positions),  # U = 1: every rank holds two chunks of the row, across a ring
    "ring_across_slices": (MULTI_IMAGE, last_labels(40)),
}


class OwnHead(torch.nn.Linear):
    """An LM head that is not a bare nn.Linear (as a PEFT or FSDP one): the CP loss calls it, as stock does."""


def _kept_real(model, batch: dict, keep) -> torch.Tensor | None:
    """Which kept logits sit at real tokens (stock computes padding, CP does not: zeros there)."""
    from vlmcp_patch.forward.keep import kept_positions

    mask = batch.get("attention_mask")
    if mask is None:
        return None
    flat = kept_positions(model, keep, tuple(mask.shape))
    return mask.reshape(-1)[flat].bool()


def _run(model, batch: dict, extra: dict):
    model.zero_grad(set_to_none=True)
    out = model(**batch, **extra)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    no_labels = {k: v for k, v in extra.items() if k not in ("labels", "shift_labels")}
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}, **no_labels).logits
        as_tuple = model(**batch, **extra, return_dict=False)
    return out.loss.detach(), grads, logits, as_tuple


def compare_keep(model, batch: dict, extra: dict, cp_size: int, ulysses_size: int = 0) -> dict:
    import vlmcp_patch

    vlmcp_patch.revert()
    try:
        ref = _run(model, batch, extra)
    finally:
        vlmcp_patch.apply()
    vlmcp_patch.enable(cp_size=cp_size, ulysses_size=ulysses_size)
    try:
        got = _run(model, batch, extra)
    finally:
        vlmcp_patch.enable(cp_size=1, ulysses_size=0)
    (ref_loss, ref_grads, ref_logits, ref_tuple), (loss, grads, logits, as_tuple) = ref, got
    real = _kept_real(model, batch, extra["logits_to_keep"])
    if real is not None:  # padding is not computed under CP (its logits are zeros): compared at real tokens
        ref_logits = ref_logits * real.view(*ref_logits.shape[:-1], 1)
        ref_tuple = (ref_tuple[0], ref_tuple[1] * real.view(*ref_logits.shape[:-1], 1))
    summed = summed_over_group(grads, vlmcp_patch.get_cp_group(cp_size).group)
    errors, _ = gradient_errors(summed, ref_grads)
    return {
        "loss": float(loss), "ref_loss": float(ref_loss), "loss_err": rel_err(loss, ref_loss),
        "grad_err": max(errors.values()), "missing_grads": sorted(set(ref_grads) - set(summed)),
        "logits_shape": tuple(logits.shape), "ref_logits_shape": tuple(ref_logits.shape),
        "logits_err": rel_err(logits, ref_logits),
        "tuple_err": max(rel_err(as_tuple[0], ref_tuple[0]), rel_err(as_tuple[1], ref_tuple[1])),
        "tuple_shapes_ok": tuple(as_tuple[1].shape) == tuple(ref_tuple[1].shape),
    }


def refusals(model, batch: dict, cp_size: int) -> dict:
    """What still cannot run, under CP: labels that do not pair with the kept logits (stock's loss fails too), positions
    outside the row (stock's slice fails too), a target of a kept logit at padding, and `logits_to_keep` through
    `token_log_probs` (it scores every position)."""
    import vlmcp_patch

    out = {}
    pair = build_batch(PADDED_PAIR, seed=7)
    width = pair["input_ids"].shape[1]
    short = int(pair["attention_mask"].sum(-1).argmin())
    keep = torch.tensor([[0, 1], [0, 1]])
    keep[short] = torch.tensor([width - 2, width - 1])  # the shorter row's last two positions: padding
    at_padding = targets_for(keep, (2, 2), ignored_every=5)
    calls = {
        "labels_of_every_position": lambda: model(**batch, logits_to_keep=9),
        "positions_outside_the_row": lambda: model(**{k: v for k, v in batch.items() if k != "labels"},
                                                   logits_to_keep=torch.tensor([3, 99])),
        "target_at_padding": lambda: model(**pair, **at_padding),
        "token_log_probs": lambda: vlmcp_patch.token_log_probs(
            model, **{k: v for k, v in batch.items() if k != "labels"}, logits_to_keep=3),
    }
    vlmcp_patch.enable(cp_size=cp_size)
    try:
        for name, call in calls.items():
            try:
                call()
                out[name] = (None, "")
            except Exception as exc:  # noqa: BLE001 - reported to the test
                out[name] = (type(exc).__name__, str(exc))
    finally:
        vlmcp_patch.enable(cp_size=1)
    return out


def run_keep_cases(rank: int, world_size: int, names: list[str]) -> dict:
    models = {"qwen3_vl": build_model(tiny_qwen3_vl_config(), seed=1),
              "qwen3_5": build_model(tiny_qwen3_5_config(), seed=1)}
    results = {}
    for name in names:
        layout, make = CASES[name]
        model = models["qwen3_5" if name.startswith("qwen3_5") else "qwen3_vl"]
        batch = build_batch(layout, seed=7)
        extra = make(batch)
        extra.setdefault("labels", None)
        if extra["labels"] is None:
            del extra["labels"]
        if "shift_labels" in extra:  # stock scores only with labels; they are not read beside shift_labels
            extra["labels"] = batch["labels"]
        batch = {k: v for k, v in batch.items() if k != "labels"}
        if name.startswith("own_head"):
            model.lm_head.__class__ = OwnHead
        try:
            results[name] = compare_keep(model, batch, extra, world_size, 1 if name.startswith("ring") else 0)
        finally:
            model.lm_head.__class__ = torch.nn.Linear
    results["refusals"] = refusals(models["qwen3_vl"], build_batch(MULTI_IMAGE, seed=7), world_size)
    return results
