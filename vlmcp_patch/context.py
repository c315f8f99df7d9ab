"""The explicit state of one CP forward.

Under CP every batch runs as one packed row of its real tokens: the samples of a packed row, or the rows
of an ordinary batch back to back with their padding dropped. A `CPContext` knows that row (its
samples, and where its tokens sit in the caller's batch), the CP group, and how the row is padded and spread
over the ranks (`layout.Split`: contiguous slices, or two chunks per Ulysses subgroup across a ring). The
top-level forward makes it current while the backbone runs (`ctx.running()`); the vision features are routed by
it there, the text decoder takes it once and hands it down the layers as the `vlmcp_ctx` keyword argument, so that
gradient-checkpointing recomputation sees the same state as the forward did.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .collectives.order import CollectiveOrder
from .distributed import CPGroup, HybridGroups, gather_sequence, hybrid_groups
from .flags import scoped
from .layout import Segment, Split, VisionShare, cu_seqlens_of
from .switches import under_choice

CTX_KWARG = "vlmcp_ctx"

_RUNNING: contextvars.ContextVar[CPContext | None] = contextvars.ContextVar("vlmcp_running_forward", default=None)


@dataclass
class RowLayout:
    """Where the tokens of the packed row sit in the caller's (batch, width) layout: `index` holds their flat
    positions in row-major order (padding left out)."""

    batch: int
    width: int
    index: torch.Tensor

    @classmethod
    def of_mask(cls, mask: torch.Tensor) -> RowLayout:
        return cls(batch=mask.shape[0], width=mask.shape[1], index=mask.reshape(-1).nonzero().flatten())

    def lengths(self) -> list[int]:
        counts = torch.bincount(self.index // self.width, minlength=self.batch)
        return counts.tolist()

    def to_row(self, x: torch.Tensor, batch_dim: int = 0) -> torch.Tensor:
        """(..., batch, width, ...) -> (..., 1, tokens, ...): the real tokens back to back."""
        flat = x.flatten(batch_dim, batch_dim + 1)
        return flat.index_select(batch_dim, self.index.to(x.device)).unsqueeze(batch_dim)

    def take(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The row's tokens at `positions`, read from the caller's layout (batch, width, ...) -> (1, len(positions),
        ...): part of the row without the whole row ever being built."""
        flat = x.flatten(0, 1)
        return flat.index_select(0, self.index[positions].to(x.device)).unsqueeze(0)

    def to_caller(self, x: torch.Tensor, batch_dim: int = 0, fill=0) -> torch.Tensor:
        """(..., 1, tokens, ...) -> (..., batch, width, ...), padding positions set to `fill`."""
        row = x.squeeze(batch_dim)
        out = row.new_full((*row.shape[:batch_dim], self.batch, self.width, *row.shape[batch_dim + 1 :]), fill)
        out.flatten(batch_dim, batch_dim + 1).index_copy_(batch_dim, self.index.to(x.device), row)
        return out  # a tensor of its own, not a view (FSDP2 hooks a module's outputs for backward)


@dataclass(frozen=True)
class SliceIndex:
    """Which of the padded row's tokens this rank holds (`CPContext.slice_index`): its real tokens — the row
    positions `positions` (ascending, CPU), one run from `start` where the slice is contiguous (R = 1, else None)
    — then `pad` CP padding tokens after every real one."""

    positions: torch.Tensor
    start: int | None
    pad: int

    def take(self, x: torch.Tensor, dim: int, value=0) -> torch.Tensor:
        """This rank's tokens of a full-row tensor along `dim`, CP padding filled with `value`: a view of a contiguous
        slice that holds no padding, otherwise a tensor of the slice's size (the whole tensor is never copied)."""
        dim = dim % x.ndim
        if self.start is not None:
            local = x.narrow(dim, self.start, self.positions.numel())
        else:
            local = x.index_select(dim, self.positions.to(x.device))
        return self.padded(local, dim, value)

    def padded(self, local: torch.Tensor, dim: int, value=0) -> torch.Tensor:
        """The slice's real tokens `local` along `dim` followed by its CP padding, filled with `value`."""
        if not self.pad:
            return local
        dim = dim % local.ndim
        widths = [0, 0] * (local.ndim - dim - 1) + [0, self.pad]
        return F.pad(local, widths, value=value)


@dataclass
class CPContext:
    """One CP forward: its group, the samples of its packed row and where they came from, and how the row is spread
    over the group (`layout.Split`: U = `ulysses` ranks exchange sequence for heads, R = P / U of those subgroups form
    rings; 0: U = P)."""

    cp: CPGroup
    segments: list[Segment]  # samples of the packed row (real tokens, back to back)
    rows: RowLayout | None = None  # the caller's batch, when it was not already the row
    ulysses: int = 0
    # Row positions (1D, ascending) of each modality's placeholder tokens ("image", "video"): the vision features
    # go to the rank whose slice holds their token (`forward.vision`); and how the ranks share each modality's
    # vision work. Both from the forward's plan (`forward.plan`).
    vision_tokens: dict[str, torch.Tensor] = field(default_factory=dict)
    vision_shares: dict[str, VisionShare] = field(default_factory=dict)
    # The caller's 1D cumulative-lengths mask of a packed row, as given: a script's own attention layers read it.
    cumulative_lengths: torch.Tensor | None = None
    # Per modality, the deepstack levels the CP vision path returned to stock's forward (`forward/vision.py`): the
    # decoder reads them in place of stock's copies (`vision.use_the_routed_deepstack_levels`).
    deepstack_levels: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    decoder_entered: bool = False  # set once by the text decoder that takes this forward (`take_for_decoder`)
    # Per ZeRO-3 leaf vision tower (by id), the anchor of its first call in this forward as that call's hooks passed it
    # on: the later calls' anchors derive from it (`forward/vision.tower_call`).
    tower_anchors: dict = field(default_factory=dict)
    # The memory switches of this forward (`switches.Choice`, chosen by need before any compute; None at P=1): in effect
    # while it runs and while what it built is recomputed in backward, whatever a later forward chose (`switches.py`).
    choice: object | None = None
    # With `logits_to_keep`: the logits stock keeps and their targets (`forward.keep.KeptLogits`); None: every logit.
    kept: object | None = None

    @property
    def seq_len(self) -> int:
        return self.segments[-1][1]

    @functools.cached_property
    def split(self) -> Split:
        return Split(self.seq_len, self.cp.size, self.ulysses or self.cp.size)

    @property
    def ring_size(self) -> int:
        return self.split.ring

    @functools.cached_property
    def groups(self) -> HybridGroups:
        """This rank's Ulysses subgroup (the CP group itself when U = P) and ring."""
        return hybrid_groups(self.cp, self.split.ulysses) if self.cp.group is not None else \
            HybridGroups(ulysses=self.cp, ring=None)

    @property
    def padded_len(self) -> int:
        return self.split.padded_len

    @property
    def pad_len(self) -> int:
        return self.padded_len - self.seq_len

    @property
    def local_len(self) -> int:
        return self.split.local_len

    @functools.cached_property
    def local_positions(self) -> torch.Tensor:
        """Row positions (padded row) of this rank's tokens, ascending (CPU)."""
        return self.split.positions(self.cp.rank)

    @property
    def local_real_len(self) -> int:
        """Real tokens of this rank (a prefix of its tokens; the rest is CP padding)."""
        return int((self.local_positions < self.seq_len).sum())

    @property
    def local_pad_len(self) -> int:
        """CP padding tokens of this rank (they lie after every real token)."""
        return self.local_len - self.local_real_len

    @property
    def contiguous(self) -> bool:
        """Whether every rank holds one contiguous slice of the row (R = 1)."""
        return self.ring_size == 1

    @property
    def attention_segments(self) -> list[Segment]:
        """The samples plus the CP pad tail as a segment of its own: kernels see the whole padded length,
        and the pad tokens attend only to each other."""
        return self.segments + ([(self.seq_len, self.padded_len)] if self.pad_len else [])

    @property
    def max_segment_len(self) -> int:
        return max(b - a for a, b in self.attention_segments)

    def cu_seqlens(self, device) -> torch.Tensor:
        return torch.tensor(cu_seqlens_of(self.attention_segments), dtype=torch.int32, device=device)

    @functools.cached_property
    def segment_ids(self) -> torch.Tensor:
        """(padded_len,) the attention segment of every position (CPU)."""
        lengths = torch.tensor([b - a for a, b in self.attention_segments])
        return torch.repeat_interleave(torch.arange(len(lengths)), lengths)

    def pad(self, x: torch.Tensor, dim: int, value=0) -> torch.Tensor:
        """Pad the sequence dimension `dim` of a full-length tensor up to the padded length."""
        if not self.pad_len:
            return x
        dim = dim % x.ndim
        widths = [0, 0] * (x.ndim - dim - 1) + [0, self.pad_len]
        return F.pad(x, widths, value=value)

    @functools.cached_property
    def slice_index(self) -> SliceIndex:
        """Which tokens of the row this rank holds, computed once per forward (`SliceIndex`)."""
        real = self.local_real_len
        start = min(int(self.local_positions[0]), self.seq_len) if self.contiguous else None
        return SliceIndex(positions=self.local_positions[:real], start=start, pad=self.local_pad_len)

    def shard(self, x: torch.Tensor, dim: int, value=0) -> torch.Tensor:
        """This rank's tokens (local_len along `dim`) of a full-length tensor, CP padding filled with `value`
        (`SliceIndex.take`)."""
        return self.slice_index.take(x, dim, value)

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The full-length tensor in row order from every rank's tokens, padding removed; backward keeps each rank's
        own tokens (`distributed.gather_sequence`)."""
        if self.contiguous:
            return gather_sequence(x, dim, self.seq_len, self.cp)
        gathered = gather_sequence(x, dim, None, self.cp)
        in_row_order = torch.argsort(torch.cat([self.split.positions(r) for r in range(self.cp.size)]))
        return gathered.index_select(dim, in_row_order[: self.seq_len].to(x.device))

    def owner_of(self, positions: torch.Tensor) -> torch.Tensor:
        """The rank holding each of `positions` (row positions; CPU); -1 for a position -1 (a token not in the row)."""
        positions = positions.cpu()
        owners = positions // self.local_len if self.contiguous else self.split.owners()[positions.clamp_min(0)]
        return torch.where(positions >= 0, owners, -1)

    def to_caller(self, x: torch.Tensor, fill=0) -> torch.Tensor:
        """A full-row tensor (1, tokens, ...) in the caller's batch layout (batch, width, ...)."""
        return x if self.rows is None else self.rows.to_caller(x, fill=fill)

    @functools.cached_property
    def order(self) -> CollectiveOrder:
        """The order of this forward's collectives (`collectives/order.py`): current while the backbone runs; the text
        decoder ties its last token into its output."""
        return CollectiveOrder(self.cp.group, self.cp.size)

    @contextlib.contextmanager
    def running(self):
        """Make this the current CP forward (its collectives' order, its switches) for the stock forward run inside the
        block; with `VLMCP_DEBUG_COLLECTIVES=1` the ranks compare their collectives when it ends."""
        with scoped(_RUNNING, self), self.order.running(), under_choice(self.choice):
            yield self
        self.order.check("in forward")


def current_cp_forward() -> CPContext | None:
    """The CP forward running now (the vision tower reads it), or None."""
    return _RUNNING.get()


def take_for_decoder() -> CPContext | None:
    """The running CP forward, once: the text decoder takes it; a second decoder call does not see it."""
    ctx = _RUNNING.get()
    if ctx is None or ctx.decoder_entered:
        return None
    ctx.decoder_entered = True
    return ctx
