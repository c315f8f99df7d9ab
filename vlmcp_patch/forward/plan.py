"""The forward's whole decision, made once before anything runs: which path a batch takes and what each rank holds.

`plan_forward` turns (the call's arguments, the model's config, the CP group) into one frozen `ForwardPlan`:

* **path** — `STOCK` (the stock forward, untouched: CP off and no packed row stock gets wrong), `AT_P1` (the
  package's path on one rank: a packed row stock would get wrong, or `token_log_probs`), or `CP`;
* **refusal** — the `Problem` to raise on every rank when the batch cannot run exactly (`refusals.py`); then
  nothing else is planned;
* **row** — which of the caller's tokens are real and the samples (attention segments) of the packed row they
  form, back to back;
* **positions** — the position ids on the caller's layout, and who computes them (`positions_from`);
* **slices** — how the row is padded and cut over the ranks (`layout.Split`: U x R, each rank's positions);
* **vision** — the row positions of each modality's placeholder tokens and how the ranks share its vision work
  (`layout.VisionShare`);
* **attention** — the attention implementation the decoder runs (with the split: Ulysses alone, or a ring).

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
from ..layout import Segment, Split, VisionShare
from ..settings import SETTINGS
from .arguments import VISION
from .batch import BatchReading, cumulative_lengths_mask, is_packed_row, read_batch, stock_gets_packed_row_right
from .positions import per_sample_mrope, stock_positions
from .refusals import Problem, Rejected, as_stock_computes, first_refusal

STOCK, AT_P1, CP = "stock", "the package's path at P=1", "CP"
# Who computes the positions: given by the caller; computed as stock computes them for the caller's batch; or, for a
# packed row, the caller's (or restarting) text positions with each sample's mRoPE computed alone.
BY_CALLER, AS_STOCK, PER_SAMPLE = "the caller", "as stock computes them", "per sample"


@dataclass(frozen=True, eq=False)  # identity, not element-wise tensor comparison
class ForwardPlan:
    """One forward's decision (module docstring). Tensors are on the batch's device; `real` (batch, seq) bool marks
    the caller's real tokens (None: every token); `segments` are the samples in row coordinates; `positions` are
    (..., batch, seq) on the caller's layout; `vision_tokens` maps a modality to the row positions (1D, ascending)
    of its placeholder tokens, `vision_shares` to its share over the ranks (under CP only);
    `cumulative_lengths` is the caller's 1D cumulative-lengths mask of a packed row, as given."""

    path: str
    cp: CPGroup | None = None
    refusal: Problem | None = None
    packed: bool = False
    real: torch.Tensor | None = None
    segments: list[Segment] = field(default_factory=list)
    positions: torch.Tensor | None = None
    positions_from: str = BY_CALLER
    split: Split | None = None
    vision_tokens: dict[str, torch.Tensor] = field(default_factory=dict)
    vision_shares: dict[str, VisionShare] = field(default_factory=dict)
    cumulative_lengths: torch.Tensor | None = None
    attention: str | None = None

    def digest(self) -> float:
        """A number every rank that planned the same computes alike (`agreement.agree`): path, row, positions'
        source, split, vision shares, attention."""
        shares = {k: (s.method, s.ranks) for k, s in sorted(self.vision_shares.items())}
        split = None if self.split is None else (self.split.seq_len, self.split.size, self.split.ulysses)
        summary = (self.path, self.packed, self.segments, self.positions_from, split, shares, self.attention,
                   self.cumulative_lengths is not None)
        return float(zlib.crc32(repr(summary).encode()))


def plan_forward(model, call: dict, cp: CPGroup | None, always: bool = False) -> ForwardPlan:
    """The plan of one forward of `model` on `call` in the CP group `cp` (None: CP off). `always`: take the
    package's path at P=1 even for a batch stock gets right (`token_log_probs`). Never raises for the batch: a
    refusal is part of the plan."""
    # 1. The path: stock, unless CP is on or this is a packed row stock would get wrong.
    packed = is_packed_row(call)
    if cp is None:
        if not (always or (packed and not stock_gets_packed_row_right(model, call))):
            return ForwardPlan(STOCK)
        cp = SINGLE_RANK
    path = CP if cp.size > 1 else AT_P1
    # 2. The batch, read once; the rules judge it; its samples; its positions (stock may refuse on the way).
    reading = read_batch(model, call, packed)
    refusal = first_refusal(model, cp, call, reading, packed)
    if refusal is not None:
        return ForwardPlan(path, cp, refusal=refusal)
    segments = _segments(reading.real, reading.starts)
    try:
        positions, positions_from = _positions(model, call, reading, packed, segments)
    except Rejected as rejected:
        return ForwardPlan(path, cp, refusal=rejected.problem)
    # 3. What each rank holds of the row: its slice, its vision share.
    text = model.config.get_text_config()
    return ForwardPlan(
        path, cp, packed=packed, real=reading.real, segments=segments, positions=positions,
        positions_from=positions_from, split=Split(segments[-1][1], cp.size, ulysses_of(text, cp.size)),
        vision_tokens={kind: _row_positions(found, reading.real) for kind, found in reading.placeholders.items()},
        vision_shares=_vision_shares(model, call, reading.placeholders, cp.size) if cp.size > 1 else {},
        cumulative_lengths=call["attention_mask"] if cumulative_lengths_mask(call) else None,
        attention=text._attn_implementation,
    )


def _positions(model, call: dict, reading: BatchReading, packed: bool,
               segments: list[Segment]) -> tuple[torch.Tensor, str]:
    """(position ids (..., batch, seq) on the caller's layout, who computes them). A packed row without 3D
    positions gets each sample's computed alone; an ordinary batch without positions gets stock's."""
    given = call.get("position_ids")
    if packed and (given is None or given.ndim == 2):
        return as_stock_computes(per_sample_mrope, getattr(model, "model", None), call, segments, given), PER_SAMPLE
    if given is None:
        return as_stock_computes(stock_positions, model, call), AS_STOCK
    return given.expand(*given.shape[:-2], *reading.shape), BY_CALLER


def _segments(real: torch.Tensor | None, starts: torch.Tensor) -> list[Segment]:
    """Segments of the packed row (the real tokens back to back) from sample starts on the caller's layout."""
    flat = starts.reshape(-1) if real is None else starts[real]
    bounds = [*flat.nonzero().flatten().tolist(), int(flat.numel())]
    return list(zip(bounds[:-1], bounds[1:]))


# ---------------------------------------------------------------------------------------------------------
# Vision


def _row_positions(found: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
    """Row positions (1D, ascending) of the tokens `found` (batch, seq) bool marks on the caller's layout."""
    return (found if real is None else found[real]).reshape(-1).nonzero().flatten()


def _vision_shares(model, call: dict, placeholders: dict, size: int) -> dict[str, VisionShare]:
    """How the `size` ranks share each modality's vision work, from its grid alone (`layout.VisionShare.decide`)."""
    if not placeholders:
        return {}
    vision = model.config.vision_config
    return {kind: VisionShare.decide(call[grid_key].tolist(), vision.spatial_merge_size, size, vision.num_heads,
                                     SETTINGS.vision_dp)
            for kind, _, grid_key, _ in VISION if kind in placeholders}
