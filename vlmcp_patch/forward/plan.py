"""The forward's whole decision, made once before anything runs: which path a batch takes and what each rank holds.

`plan_forward` turns (the call's arguments, the model's config, the CP group) into one frozen `ForwardPlan`:

* **path** — `STOCK` (the stock forward, untouched: CP off and no packed row stock gets wrong), `AT_P1` (the
  package's path on one rank: a packed row stock would get wrong, or `token_log_probs`), or `CP`;
* **refusal** — the `Problem` to raise on every rank when the batch cannot run exactly (`refusals.py`); then
  nothing else is planned;
* **row** — which of the caller's tokens are real and the samples (attention segments) of the packed row they
  form, back to back;
* **positions** — the position ids on the caller's layout;
* **slices** — how the row is padded and cut over the ranks: U of the P = U x R layout (`layout.Split` follows
  from it and the row: each rank's positions);
* **vision** — the row positions of each modality's placeholder tokens and how the ranks share its vision work
  (`layout.VisionShare`);
* **kept logits** — with `logits_to_keep` (the top-level forward's), the row positions of the logits stock keeps and
  their targets (`keep.KeptLogits`);
* **digest** — one number for every decision, those the later steps do not read included (a packed row or not, who
  computed the positions, the attention implementation): the agreement compares it over the group.

Everything after reads the plan and asks the batch nothing again: `agreement.agree` fingerprints the batch and
the plan, `rows.lay_out` lays the row out, `slicing.cut_to_slice` cuts it, `vision.py` encodes its share. The
questions it asks are `batch.py`'s, the rules `refusals.py`'s, the positions stock would compute `positions.py`'s.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch

from ..attention.heads import ulysses_of
from ..distributed import SINGLE_RANK, CPGroup
from ..errors import Problem
from ..layout import Segment, Split, VisionShare
from ..settings import SETTINGS
from .batch import read_batch
from .keep import KeptLogits
from .positions import positions_of
from .refusals import first_refusal
from .vision import encodes_patch_slices

STOCK, AT_P1, CP = "stock", "the package's path at P=1", "CP"
# Stock's own refusals while it computes positions (e.g. images without `mm_token_type_ids`): the batch's refusal,
# the same type and message on every rank.
STOCK_REFUSALS = (ValueError, IndexError, RuntimeError)


@dataclass(frozen=True, eq=False)  # identity, not element-wise tensor comparison
class ForwardPlan:
    """One forward's decision (module docstring). Tensors are on the batch's `device`; `shape` is the caller's
    (batch, seq); `real` (batch, seq) bool marks the caller's real tokens (None: every token); `segments` are the
    samples in row coordinates; `positions` are (..., batch, seq) on the caller's layout; `vision_tokens` maps a
    modality to the row positions (1D, ascending) of its placeholder tokens, `vision_shares` to its share over the
    ranks (under CP only); `cumulative_lengths` is the caller's 1D cumulative-lengths mask of a packed row, as
    given. A plan with a `refusal` holds nothing else but the device. It holds what the steps after it read; the
    decisions only the agreement compares are in the `digest` alone."""

    path: str
    cp: CPGroup | None = None
    refusal: Problem | None = None
    device: torch.device | None = None
    shape: tuple[int, int] | None = None
    real: torch.Tensor | None = None
    segments: list[Segment] = field(default_factory=list)
    positions: torch.Tensor | None = None
    ulysses: int = 1  # U of the P = U x R layout
    vision_tokens: dict[str, torch.Tensor] = field(default_factory=dict)
    vision_shares: dict[str, VisionShare] = field(default_factory=dict)
    cumulative_lengths: torch.Tensor | None = None
    kept: KeptLogits | None = None  # `logits_to_keep`'s logits and their targets; None: every logit
    digest: float = 0.0  # every rank that planned alike has the same (`agreement.agree`; `_digest`)


def plan_forward(model, call: dict, cp: CPGroup | None, always: bool = False,
                 keeps_logits: bool = False) -> ForwardPlan:
    """The plan of one forward of `model` on `call` in the CP group `cp` (None: CP off). `always`: take the
    package's path at P=1 even for a batch stock gets right (`token_log_probs`). `keeps_logits`: the caller scores
    the logits `logits_to_keep` keeps (the top-level forward; elsewhere it is refused). Never raises for the batch: a
    refusal is part of the plan."""
    # 1. The batch, read once; the path: stock, unless CP is on or this is a packed row stock would get wrong.
    reading = read_batch(model, call, stock_allowed=cp is None and not always)
    if reading.stock_gets_it_right:
        return ForwardPlan(STOCK)
    cp = cp or SINGLE_RANK
    path, packed = CP if cp.size > 1 else AT_P1, reading.packed
    # 2. The rules judge the reading; the positions (stock may refuse on the way).
    refusal, kept = first_refusal(model, cp, call, reading, packed, keeps_logits)
    if refusal is None:
        try:
            positions, positions_from = positions_of(model, call, reading, packed)
        except STOCK_REFUSALS as exc:
            refusal = Problem(type(exc), str(exc))
    if refusal is not None:
        return ForwardPlan(path, cp, refusal=refusal, device=reading.device)
    # 3. What each rank holds of the row: its slice, its vision share.
    text, vision = model.config.get_text_config(), getattr(model.config, "vision_config", None)
    # U is computed again here after the rules checked it (`refusals.check_model_config`): they must judge it in
    # their order, and after the first forward of a launch it is arithmetic (P=1: no question at all).
    split = Split(reading.segments[-1][1], cp.size, ulysses_of(text, cp.size))
    shares = {} if cp.size == 1 else VisionShare.decide_each(reading.grids, vision, cp.size, SETTINGS.vision_dp,
                                                             encodes_patch_slices(model))
    return ForwardPlan(
        path, cp, device=reading.device, shape=reading.shape, real=reading.real, segments=reading.segments,
        positions=positions, ulysses=split.ulysses, vision_tokens=reading.placeholder_rows, vision_shares=shares,
        cumulative_lengths=reading.cumulative_mask, kept=kept,
        digest=_digest(path, packed, reading.segments, positions_from, split, shares, text._attn_implementation,
                       reading.cumulative_mask is not None),
    )


def _digest(path: str, packed: bool, segments: list[Segment], positions_from: str, split: Split,
            shares: dict[str, VisionShare], attention: str, cumulative: bool) -> float:
    """A number for a plan's decisions (path, row, positions' source, split, vision shares, attention): the
    agreement compares it over the group, so ranks that would take different paths stop together."""
    summary = (path, packed, segments, positions_from, (split.seq_len, split.size, split.ulysses),
               {kind: (share.method, share.ranks) for kind, share in sorted(shares.items())}, attention, cumulative)
    return float(zlib.crc32(repr(summary).encode()))
