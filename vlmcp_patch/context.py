"""The explicit state of one CP forward.

Under CP every batch runs as one packed row of its real tokens: the samples of a packed row, or the rows
of an ordinary batch back to back with their padding dropped. A `CPContext` knows that row (its
samples, and where its tokens sit in the caller's batch), the CP group, and how the row is padded to a
multiple of the CP size and cut into per-rank slices. The top-level forward makes it current while
the backbone runs (`ctx.running()`); the vision tower reads it there, the text decoder takes
it once and hands it down the layers as the `vlmcp_ctx` keyword argument, so that gradient-checkpointing
recomputation sees the same state as the forward did.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .distributed import CPGroup, gather_sequence
from .flags import scoped
from .layout import Segment, cu_seqlens_of, round_up, shard_slice

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

    def take(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Tokens [start, stop) of the row, read from the caller's layout (batch, width, ...) -> (1, stop - start,
        ...): a slice of the row without the whole row ever being built."""
        flat = x.flatten(0, 1)
        return flat.index_select(0, self.index[start:stop].to(x.device)).unsqueeze(0)

    def to_caller(self, x: torch.Tensor, batch_dim: int = 0, fill=0) -> torch.Tensor:
        """(..., 1, tokens, ...) -> (..., batch, width, ...), padding positions set to `fill`."""
        row = x.squeeze(batch_dim)
        out = row.new_full((*row.shape[:batch_dim], self.batch, self.width, *row.shape[batch_dim + 1 :]), fill)
        out.flatten(batch_dim, batch_dim + 1).index_copy_(batch_dim, self.index.to(x.device), row)
        return out  # a tensor of its own, not a view (FSDP2 hooks a module's outputs for backward)


@dataclass
class CPContext:
    """One CP forward: its group, the samples of its packed row and where they came from."""

    cp: CPGroup
    segments: list[Segment]  # samples of the packed row (real tokens, back to back)
    rows: RowLayout | None = None  # the caller's batch, when it was not already the row
    # Row positions (1D, ascending) of each modality's placeholder tokens ("image", "video"): the vision features
    # go to the rank whose slice holds their token (`forward.vision`).
    vision_tokens: dict[str, torch.Tensor] = field(default_factory=dict)
    # The caller's 1D cumulative-lengths mask of a packed row, as given: a script's own attention layers read it.
    cumulative_lengths: torch.Tensor | None = None
    decoder_entered: bool = False  # set once by the text decoder that takes this forward (`take_for_decoder`)

    @property
    def seq_len(self) -> int:
        return self.segments[-1][1]

    @property
    def padded_len(self) -> int:
        return round_up(self.seq_len, self.cp.size)

    @property
    def pad_len(self) -> int:
        return self.padded_len - self.seq_len

    @property
    def local_len(self) -> int:
        return self.padded_len // self.cp.size

    @property
    def local_slice(self) -> slice:
        return shard_slice(self.seq_len, self.cp.size, self.cp.rank)

    @property
    def local_pad_len(self) -> int:
        """CP padding tokens in this rank's slice (the pad tail lies after every real token)."""
        real = max(0, min(self.seq_len - self.local_slice.start, self.local_len))
        return self.local_len - real

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

    def pad(self, x: torch.Tensor, dim: int, value=0) -> torch.Tensor:
        """Pad the sequence dimension `dim` of a full-length tensor up to a multiple of the CP size."""
        if not self.pad_len:
            return x
        dim = dim % x.ndim
        widths = [0, 0] * (x.ndim - dim - 1) + [0, self.pad_len]
        return F.pad(x, widths, value=value)

    @property
    def local_real_len(self) -> int:
        """Real tokens in this rank's slice (the rest is CP padding)."""
        return self.local_len - self.local_pad_len

    def shard(self, x: torch.Tensor, dim: int, value=0) -> torch.Tensor:
        """This rank's contiguous slice (local_len along `dim`) of a full-length tensor, CP padding filled with
        `value`: a view when the slice holds no padding, otherwise a tensor of the slice's size (the whole tensor
        is never copied)."""
        dim = dim % x.ndim
        start = min(self.local_slice.start, self.seq_len)
        local = x.narrow(dim, start, self.local_real_len)
        if not self.local_pad_len:
            return local
        widths = [0, 0] * (x.ndim - dim - 1) + [0, self.local_pad_len]
        return F.pad(local, widths, value=value)

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The full-length tensor from every rank's slice, padding removed (`distributed.gather_sequence`)."""
        return gather_sequence(x, dim, self.seq_len, self.cp)

    def to_caller(self, x: torch.Tensor, fill=0) -> torch.Tensor:
        """A full-row tensor (1, tokens, ...) in the caller's batch layout (batch, width, ...)."""
        return x if self.rows is None else self.rows.to_caller(x, fill=fill)

    def running(self):
        """Make this the current CP forward for the stock forward run inside the block."""
        return scoped(_RUNNING, self)


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
