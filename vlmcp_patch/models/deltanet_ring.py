"""The gated DeltaNet layer across a CP ring (P = U x R with R > 1): the sequence split over the R subgroups.

Inside its Ulysses subgroup a rank holds, for its share of the heads, two chunks of the row (`layout.Split`: chunk g
and chunk 2R-1-g of 2R). Both DeltaNet stages run in row order, so each chunk needs what the chunks before it left:

* **the causal conv** reads the kernel-1 tokens before each position: a chunk takes them (its *halo*) from the end of
  the chunks before it, as far as they belong to the same sample;
* **the gated delta rule** carries a state S (K x V per head) from token to token. It is affine in the state a chunk
  starts from: S_out = M S_in + B, where B is the chunk's final state from a zero state and M (K x K) its final state
  from the identity with zero values. Every subgroup computes (M, B) of its chunks, one all-gather around the ring
  (its size does not depend on the sequence length) brings every chunk's, and each subgroup composes those before
  its chunks into their true initial states — then runs its chunks from them. A sample that starts inside a chunk
  cuts the chain there: the chunk's final state no longer depends on its initial one (M = 0), and only the tokens
  before that start do.

The per-chunk steps (`conv_of_chunk`, `transfer_of_chunk`, `compose`, `rule_of_chunk`) are pure functions of a chunk
and the segments inside it, tested alone against the sequential recurrence; the ring functions feed them. The halos
and the transfers travel by an all-gather whose backward sums the gradient over the ring and keeps each member's own
block, so every gradient reaches the chunk that produced it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..collectives.differentiable import gather_over_group
from ..context import CPContext


@dataclass(frozen=True)
class Piece:
    """One sample's tokens inside a chunk: [start, end) in chunk coordinates; `before`: how many tokens of the same
    sample precede the chunk (0: the sample starts here)."""

    start: int
    end: int
    before: int


def pieces_of(segments, first: int, last: int) -> list[Piece]:
    """The pieces of the row's `segments` ([a, b) in row positions) inside the chunk [first, last)."""
    return [Piece(max(a, first) - first, min(b, last) - first, max(0, first - a)) for a, b in segments
            if a < last and b > first]


# ---------------------------------------------------------------------------------------------------------
# One chunk


def conv_of_chunk(conv: Callable, x: torch.Tensor, pieces: list[Piece], halo: torch.Tensor | None, **options):
    """The causal conv of one chunk x (B, C, T), each sample alone; the piece continuing a sample reads the last of
    `halo` (B, C, kernel - 1: the tokens before the chunk) that belong to it."""
    outs = []
    for piece in pieces:
        tokens = x[..., piece.start:piece.end]
        reach = min(piece.before, 0 if halo is None else halo.shape[-1])
        if reach:
            tokens = torch.cat([halo[..., halo.shape[-1] - reach:], tokens], dim=2)
        outs.append(conv(tokens, **options)[..., reach:])
    return torch.cat(outs, dim=2)


def transfer_of_chunk(rule: Callable, q, k, v, g, beta, pieces: list[Piece]) -> torch.Tensor:
    """[M | B] (B, Hv, K, K + V): the chunk's final state as an affine function of the state it starts from.
    `rule(q, k, v, g, beta, initial_state) -> (output, final state)` runs one piece."""
    last = pieces[-1]
    part = [t[:, last.start:last.end] for t in (q, k, v, g, beta)]
    _, final = rule(*part, initial_state=None)  # B: from a zero state
    batch, heads, keys = v.shape[0], v.shape[2], q.shape[-1]
    if last.before and last.start == 0:  # one piece, continuing the sample before: M from the identity
        identity = torch.eye(keys, dtype=final.dtype, device=final.device).expand(batch, heads, keys, keys)
        zeros = part[2].new_zeros(*part[2].shape[:-1], keys)
        _, linear = rule(part[0], part[1], zeros, part[3], part[4], initial_state=identity.contiguous())
    else:  # a sample starts inside the chunk (or with it): the chunk ends in a state of its own
        linear = final.new_zeros(batch, heads, keys, keys)
    return torch.cat([linear, final], dim=-1)


def compose(transfers: list[torch.Tensor], keys: int) -> torch.Tensor | None:
    """The state after the chunks whose transfers are given, in row order, from a zero state (None: no chunk)."""
    state = None
    for transfer in transfers:
        linear, final = transfer.split([keys, transfer.shape[-1] - keys], dim=-1)
        state = final if state is None else torch.matmul(linear, state) + final
    return state


def rule_of_chunk(rule: Callable, q, k, v, g, beta, pieces: list[Piece], state) -> torch.Tensor:
    """The gated delta rule of one chunk, each sample alone, the piece continuing a sample from `state`."""
    outs = []
    for piece in pieces:
        part = [t[:, piece.start:piece.end] for t in (q, k, v, g, beta)]
        outs.append(rule(*part, initial_state=state if piece.before else None)[0])
    return torch.cat(outs, dim=1)


# ---------------------------------------------------------------------------------------------------------
# Around the ring


def _own_chunks(ctx: CPContext) -> tuple[int, ...]:
    """The chunks of this rank's subgroup, in the order its tokens hold them."""
    return ctx.split.chunks_of(ctx.groups.ring.index)


def _pieces(ctx: CPContext, chunk: int) -> list[Piece]:
    length = ctx.split.chunk_len
    return pieces_of(ctx.attention_segments, chunk * length, (chunk + 1) * length)


def _gathered_by_chunk(ctx: CPContext, mine: torch.Tensor) -> list[torch.Tensor]:
    """Every chunk's entry, in row order, of a per-chunk tensor (2, ...) each ring member holds for its two chunks."""
    ring = ctx.groups.ring
    gathered = gather_over_group(mine.contiguous(), ring.group, ring.size)  # (R, 2, ...)
    by_chunk = {chunk: gathered[member, slot] for member in range(ring.size)
                for slot, chunk in enumerate(ctx.split.chunks_of(member))}
    return [by_chunk[chunk] for chunk in range(len(by_chunk))]


def conv_over_ring(conv: Callable, mixed: torch.Tensor, ctx: CPContext, **options) -> torch.Tensor:
    """The causal conv of this subgroup's two chunks, mixed (B, C, 2 x chunk) -> the same shape (module docstring);
    `options`: the conv's weight, bias and activation."""
    halo, length = options["weight"].shape[-1] - 1, ctx.split.chunk_len
    chunks = mixed.split(length, dim=2)
    tails = _gathered_by_chunk(ctx, torch.stack([c[..., max(0, length - halo):] for c in chunks]))
    outs = []
    for chunk, x in zip(_own_chunks(ctx), chunks):
        before = torch.cat(tails[:chunk], dim=-1)[..., -halo:] if chunk else None  # chunks may be shorter than halo
        outs.append(conv_of_chunk(conv, x, _pieces(ctx, chunk), before, **options))
    return torch.cat(outs, dim=2)


def delta_rule_over_ring(rule: Callable, q, k, v, g, beta, ctx: CPContext) -> torch.Tensor:
    """The gated delta rule of this subgroup's two chunks, q, k (B, 2 x chunk, Hk, K), v (B, 2 x chunk, Hv, V), g,
    beta (B, 2 x chunk, Hv), each chunk from its true initial state (module docstring): output (B, 2 x chunk, Hv, V).
    `rule(q, k, v, g, beta, initial_state) -> (output, final state)` runs one piece of one sample."""
    length = ctx.split.chunk_len
    mine = [[t.narrow(1, slot * length, length) for t in (q, k, v, g, beta)] for slot in range(2)]
    transfers = _gathered_by_chunk(ctx, torch.stack([
        transfer_of_chunk(rule, *tensors, _pieces(ctx, chunk)) for chunk, tensors in zip(_own_chunks(ctx), mine)]))
    return torch.cat([rule_of_chunk(rule, *tensors, _pieces(ctx, chunk), compose(transfers[:chunk], q.shape[-1]))
                      for chunk, tensors in zip(_own_chunks(ctx), mine)], dim=1)
