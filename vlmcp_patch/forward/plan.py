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

from ..distributed import SINGLE_RANK, CPGroup
from ..layout import Segment, Split, VisionShare, starts_of
from ..settings import SETTINGS
from .arguments import CU_SEQ_LENS, VISION, batch_reference
from .batch import (
    cumulative_lengths_mask,
    has_deltanet,
    is_packed_row,
    stock_gets_packed_row_right,
    stock_restarts,
    text_positions,
    ulysses_of,
)
from .positions import per_sample_mrope, stock_positions
from .refusals import (
    Problem,
    Rejected,
    as_stock_computes,
    check_batch,
    check_cu_seq_lens_k,
    check_mask,
    check_mrope_starts,
    check_no_cu_seq_lens,
    check_padding,
    check_setup,
    check_starts_agree,
    refuse_restarts_under_deltanet,
    starts_of_cumulative,
)

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
    # The path: stock, unless CP is on or this is a packed row stock would get wrong.
    packed = is_packed_row(call)
    if cp is None:
        if not (always or (packed and not stock_gets_packed_row_right(model, call))):
            return ForwardPlan(STOCK)
        cp = SINGLE_RANK
    path = CP if cp.size > 1 else AT_P1
    text = model.config.get_text_config()
    ulysses, cumulative = ulysses_of(text, cp.size), cumulative_lengths_mask(call)
    # The rules, and the row they let through; any refusal becomes the plan.
    try:
        check_setup(model, cp, call)
        shape, placeholders = check_batch(model, call)
        real, segments, positions, positions_from = (_packed_row if packed else _ordinary_batch)(model, call, shape)
    except Rejected as rejected:
        return ForwardPlan(path, cp, refusal=rejected.problem)
    # What each rank holds: its slice of the row, its vision share.
    return ForwardPlan(
        path, cp, packed=packed, real=real, segments=segments, positions=positions, positions_from=positions_from,
        split=Split(segments[-1][1] if segments else 0, cp.size, ulysses),
        vision_tokens={kind: _row_positions(found, real) for kind, found in placeholders.items()},
        vision_shares=_vision_shares(model, call, placeholders, cp.size) if cp.size > 1 else {},
        cumulative_lengths=call["attention_mask"] if cumulative else None,
        attention=text._attn_implementation,
    )


# ---------------------------------------------------------------------------------------------------------
# The row: a packed row as given, or an ordinary batch's real tokens back to back


def _packed_row(model, call: dict, shape: tuple[int, int]):
    """(real, segments, positions, who computes them) of a packed row in the documented convention."""
    segments = _segments(None, _packed_row_starts(call, shape[1]))
    positions = call.get("position_ids")
    if positions is not None and positions.ndim == 3:
        return None, segments, positions, BY_CALLER
    positions = as_stock_computes(per_sample_mrope, getattr(model, "model", None), call, segments, positions)
    return None, segments, positions, PER_SAMPLE


def _packed_row_starts(call: dict, seq: int) -> torch.Tensor:
    """(1, seq) bool sample starts of a packed row, from its text positions and / or cumulative lengths."""
    text = text_positions(call)
    starts = None if text is None else starts_of(text)
    mask_cu = call["attention_mask"] if cumulative_lengths_mask(call) else None
    for name, cu in (("attention_mask", mask_cu), ("cu_seq_lens_q", call.get("cu_seq_lens_q"))):
        if cu is None:
            continue
        from_cu = starts_of_cumulative(cu, seq, name)
        check_starts_agree(name, cu, from_cu, starts)
        starts = from_cu
    check_cu_seq_lens_k(call)
    check_mrope_starts(call.get("position_ids"), starts)
    return starts


def _ordinary_batch(model, call: dict, shape: tuple[int, int]):
    """(real, segments, positions, who computes them) of rows with a padding mask of any pattern, or none: each
    row's real tokens are one sample, split further where stock splits attention inside a row."""
    mask = call.get("attention_mask")
    deltanet = has_deltanet(model.config.get_text_config())
    check_no_cu_seq_lens(call, CU_SEQ_LENS)
    device = batch_reference(call).device
    real = None if mask is None else check_mask(mask, shape, deltanet)
    if real is not None:
        check_padding(call, real, deltanet)
    starts = torch.zeros(shape, dtype=torch.bool, device=device)
    first = torch.ones(shape, dtype=torch.bool, device=device) if real is None else real
    starts[torch.arange(shape[0], device=device), first.int().argmax(-1)] = True  # each row's first real token
    text = text_positions(call)
    restarts = None if real is not None or text is None else stock_restarts(model, call, text, shape[0])
    if restarts is not None:
        if deltanet:
            refuse_restarts_under_deltanet()
        starts |= restarts.to(device)
    positions = call.get("position_ids")
    if positions is None:
        return real, _segments(real, starts), as_stock_computes(stock_positions, model, call), AS_STOCK
    return real, _segments(real, starts), positions.expand(*positions.shape[:-2], *shape), BY_CALLER


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
