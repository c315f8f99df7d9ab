"""The explicit state of one CP forward.

A `CPContext` is created by the patched top-level forward for one batch. It knows the CP group, how
the sequence is padded and cut into per-rank slices, where samples start and end (padding mask or
packed boundaries) and counts the exchanges it performs. It reaches the decoder through a
`contextvars` hand-off and then travels down the decoder layers as the `vlmcp_ctx` keyword argument,
so that gradient-checkpointing recomputation sees the same state as the forward did.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .collectives import gather_keep_local_grad
from .distributed import CPGroup
from .settings import SETTINGS

CTX_KWARG = "vlmcp_ctx"

# Set by the top-level forward, consumed by the decoder forward it calls.
_PENDING: contextvars.ContextVar[CPContext | None] = contextvars.ContextVar("vlmcp_pending", default=None)
_BYPASS: contextvars.ContextVar[bool] = contextvars.ContextVar("vlmcp_bypass", default=False)


def sample_starts(text_position_ids: torch.Tensor) -> torch.Tensor:
    """Boolean (B, S): True where a packed sample starts, i.e. the position does not continue by +1."""
    starts = torch.diff(text_position_ids, dim=-1) != 1
    return torch.cat([torch.ones_like(starts[:, :1]), starts], dim=-1)


@dataclass
class CPContext:
    cp: CPGroup
    batch_size: int
    seq_len: int
    # (B, padded_len) bool, True for real tokens; only when the batch carries padding.
    padding_mask: torch.Tensor | None = None
    # Packed samples of a single row, over the padded length: (start, end) pairs and cu_seqlens.
    segments: list[tuple[int, int]] | None = None
    cu_seqlens: torch.Tensor | None = None
    exchanges: Counter = field(default_factory=Counter)

    @classmethod
    def create(
        cls,
        cp: CPGroup,
        batch_size: int,
        seq_len: int,
        device: torch.device,
        attention_mask: torch.Tensor | None = None,
        text_position_ids: torch.Tensor | None = None,
    ) -> CPContext:
        ctx = cls(cp=cp, batch_size=batch_size, seq_len=seq_len)
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            ctx.padding_mask = F.pad(attention_mask.bool(), (0, ctx.pad_len), value=False)
        elif text_position_ids is not None and attention_mask is None:
            starts = sample_starts(text_position_ids.expand(batch_size, -1))
            if bool(starts[:, 1:].any()):
                ctx._set_segments(starts[0])
        return ctx

    def _set_segments(self, starts: torch.Tensor) -> None:
        bounds = starts.nonzero().flatten().tolist() + [self.seq_len]
        segments = list(zip(bounds[:-1], bounds[1:]))
        if self.pad_len:
            segments.append((self.seq_len, self.padded_len))
        self.segments = segments
        edges = [0] + [end for _, end in segments]
        self.cu_seqlens = torch.tensor(edges, dtype=torch.int32, device=starts.device)

    @property
    def padded_len(self) -> int:
        return -(-self.seq_len // self.cp.size) * self.cp.size

    @property
    def pad_len(self) -> int:
        return self.padded_len - self.seq_len

    @property
    def local_len(self) -> int:
        return self.padded_len // self.cp.size

    @property
    def local_slice(self) -> slice:
        start = self.cp.rank * self.local_len
        return slice(start, start + self.local_len)

    @property
    def real_segments(self) -> list[tuple[int, int]] | None:
        """The packed samples without the CP pad tail."""
        if self.segments is None:
            return None
        return [(a, b) for a, b in self.segments if b <= self.seq_len]

    @property
    def max_segment_len(self) -> int:
        return max(end - start for start, end in self.segments)

    def pad(self, x: torch.Tensor, dim: int, value=0) -> torch.Tensor:
        """Pad the sequence dimension `dim` of a full-length tensor up to a multiple of the CP size."""
        if not self.pad_len:
            return x
        dim = dim % x.ndim
        widths = [0, 0] * (x.ndim - dim - 1) + [0, self.pad_len]
        return F.pad(x, widths, value=value)

    def shard(self, x: torch.Tensor, dim: int, value=0) -> torch.Tensor:
        """This rank's contiguous slice of a full-length tensor (padded first)."""
        index = [slice(None)] * x.ndim
        index[dim] = self.local_slice
        return self.pad(x, dim, value)[tuple(index)]

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The full-length tensor from every rank's slice, padding removed (see `gather_keep_local_grad`)."""
        full = gather_keep_local_grad(x, dim, self.cp.group, self.cp.size, self.cp.rank)
        return full.narrow(dim, 0, self.seq_len)

    @contextlib.contextmanager
    def handed_to_decoder(self):
        token = _PENDING.set(self)
        try:
            yield self
        finally:
            _PENDING.reset(token)


def take_pending() -> CPContext | None:
    """The context handed over by the top-level forward, once: a second decoder call does not see it."""
    ctx = _PENDING.get()
    if ctx is not None:
        _PENDING.set(None)
    return ctx


def bypassed() -> bool:
    """Inside `vlmcp_patch.disabled()`."""
    return _BYPASS.get()


def cp_requested() -> bool:
    """CP is configured (size > 1) and not bypassed by `vlmcp_patch.disabled()`."""
    return SETTINGS.cp_size > 1 and not _BYPASS.get()


@contextlib.contextmanager
def disabled():
    """Run the forwards inside this block without CP (each rank computes the full sequence alone).

    Use it for `generate()`, evaluation on a single rank, or debugging.
    """
    token = _BYPASS.set(True)
    try:
        yield
    finally:
        _BYPASS.reset(token)
