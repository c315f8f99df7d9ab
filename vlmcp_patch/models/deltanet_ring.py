"""The gated DeltaNet layer across a CP ring (P = U x R with R > 1): the sequence split over the R subgroups.

Inside its Ulysses subgroup a rank holds, for its share of the heads, two chunks of the row (`layout.Split`: chunk g
and chunk 2R-1-g of 2R). Both DeltaNet stages run in row order, so each chunk needs what the chunks before it left:

* **the causal conv** reads the kernel-1 tokens before each position: a chunk takes them (its *halo*) from the end of
  the previous chunk, as far as they belong to the same sample;
* **the gated delta rule** carries a state S (K x V per head) from token to token. It is affine in the state a chunk
  starts from: S_out = M S_in + B, where B is the chunk's final state from a zero state and M (K x K) its final state
  from the identity with zero values. Every subgroup computes (M, B) of its chunks, one all-gather around the ring
  (its size does not depend on the sequence length) brings every chunk's, and each subgroup composes those before
  its chunks into their true initial states — then runs its chunks from them. A sample that starts inside a chunk
  cuts the chain there: the chunk's final state no longer depends on its initial one (M = 0), and only the tokens
  before that start do.

The halos and the transfers travel by an all-gather whose backward sums the gradient over the ring and keeps each
member's own block, so every gradient reaches the chunk that produced it. The result equals the stock layer run on
each sample alone, up to fp32 rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..collectives import gather_over_group
from ..context import CPContext


def _chunk_segments(ctx: CPContext, chunk: int) -> list[tuple[int, int, bool]]:
    """(start, end, continues) of each attention segment inside `chunk`, in chunk coordinates; `continues`: the
    segment began before the chunk."""
    length = ctx.split.chunk_len
    first, last = chunk * length, (chunk + 1) * length
    return [(max(a, first) - first, min(b, last) - first, a < first) for a, b in ctx.attention_segments
            if a < last and b > first]


def own_chunks(ctx: CPContext) -> tuple[int, ...]:
    """The chunks of this rank's subgroup, in the order its tokens hold them."""
    return ctx.split.chunks_of(ctx.groups.ring.index)


def _gathered_by_chunk(ctx: CPContext, mine: torch.Tensor) -> dict[int, torch.Tensor]:
    """Every chunk's entry of a per-chunk tensor (2, ...) that each ring member holds for its own two chunks."""
    ring = ctx.groups.ring
    gathered = gather_over_group(mine.contiguous(), ring.group, ring.size, ring.index)  # (R, 2, ...)
    return {chunk: gathered[member, slot] for member in range(ring.size)
            for slot, chunk in enumerate(ctx.split.chunks_of(member))}


def conv_over_ring(conv: Callable, mixed: torch.Tensor, weight, bias, activation, ctx: CPContext) -> torch.Tensor:
    """The depthwise causal conv of this subgroup's two chunks, mixed (B, C, 2 x chunk) -> the same shape; each
    sample's conv reads back into the previous chunk through the halo (module docstring)."""
    halo, length = weight.shape[-1] - 1, ctx.split.chunk_len
    chunks = mixed.split(length, dim=2)
    tails = _gathered_by_chunk(ctx, torch.stack([c[..., max(0, length - halo):] for c in chunks]))  # (2, B, C, t)
    outs = []
    for chunk, x in zip(own_chunks(ctx), chunks):
        for start, end, continues in _chunk_segments(ctx, chunk):
            piece = x[..., start:end]
            before = min(halo, _segment_start_distance(ctx, chunk)) if continues and start == 0 else 0
            if before:
                piece = torch.cat([_halo(tails, chunk, before), piece], dim=2)
            outs.append(conv(piece, weight=weight, bias=bias, activation=activation)[..., before:])
    return torch.cat(outs, dim=2)


def _halo(tails: dict[int, torch.Tensor], chunk: int, count: int) -> torch.Tensor:
    """The `count` tokens before `chunk`, from the tails of the chunks before it (chunks may be shorter than a
    halo)."""
    behind = [tails[previous] for previous in range(max(0, chunk - count), chunk)]
    return torch.cat(behind, dim=-1)[..., -count:]


def _segment_start_distance(ctx: CPContext, chunk: int) -> int:
    """How many tokens before the chunk the segment holding its first token began."""
    first = chunk * ctx.split.chunk_len
    return first - next(a for a, b in ctx.attention_segments if a < first < b or a == first)


def delta_rule_over_ring(rule: Callable, q, k, v, g, beta, ctx: CPContext) -> torch.Tensor:
    """The gated delta rule of this subgroup's two chunks, q, k (B, 2 x chunk, Hk, K), v (B, 2 x chunk, Hv, V), g,
    beta (B, 2 x chunk, Hv), with each chunk's true initial state (module docstring): output (B, 2 x chunk, Hv, V).
    `rule(q, k, v, g, beta, initial_state) -> (output, final state)` runs one piece of one sample."""
    length = ctx.split.chunk_len
    pieces = [tuple(t.narrow(1, slot * length, length) for t in (q, k, v, g, beta)) for slot in range(2)]
    transfers = torch.stack([_transfer(rule, piece, ctx, chunk) for chunk, piece in zip(own_chunks(ctx), pieces)])
    by_chunk = _gathered_by_chunk(ctx, transfers)  # chunk -> (K, K + V) per batch row and head: [M | B]
    keys = q.shape[-1]
    outs = []
    for chunk, piece in zip(own_chunks(ctx), pieces):
        state = _state_before(by_chunk, chunk, keys)
        for start, end, continues in _chunk_segments(ctx, chunk):
            part = tuple(t[:, start:end] for t in piece)
            outs.append(rule(*part, initial_state=state if continues and start == 0 else None)[0])
    return torch.cat(outs, dim=1)


def _transfer(rule: Callable, piece, ctx: CPContext, chunk: int) -> torch.Tensor:
    """[M | B] (B, Hv, K, K + V): the chunk's final state as an affine function of its initial state."""
    q, k, v, g, beta = piece
    segments = _chunk_segments(ctx, chunk)
    start, end, continues = segments[-1]
    part = tuple(t[:, start:end] for t in piece)
    _, final = rule(*part, initial_state=None)  # B: from a zero state
    batch, heads, keys = v.shape[0], v.shape[2], q.shape[-1]
    if continues and start == 0:  # one piece that continues the previous chunk's sample: M from the identity
        identity = torch.eye(keys, dtype=final.dtype, device=final.device).expand(batch, heads, keys, keys)
        zeros = v.new_zeros(*part[2].shape[:-1], keys)
        _, linear = rule(part[0], part[1], zeros, part[3], part[4], initial_state=identity.contiguous())
    else:  # a sample starts inside the chunk (or with it): the chunk ends in a state of its own
        linear = final.new_zeros(batch, heads, keys, keys)
    return torch.cat([linear, final], dim=-1)


def _state_before(by_chunk: dict[int, torch.Tensor], chunk: int, keys: int) -> torch.Tensor | None:
    """The state the chunk starts from: the transfers of the chunks before it composed, from a zero state."""
    state = None
    for previous in range(chunk):
        linear, final = by_chunk[previous].split([keys, by_chunk[previous].shape[-1] - keys], dim=-1)
        state = final if state is None else torch.matmul(linear, state) + final
    return state
