"""Ring attention across the Ulysses subgroups, for CP sizes beyond (or not dividing) the heads: P = U x R.

After the all-to-all inside its Ulysses subgroup (`ulysses.py`) a rank holds, for its H/U heads, q, k and v of its
subgroup's share of the row — two chunks of it in the zigzag layout (`layout.Split`: subgroup g holds chunks
g and 2R-1-g of 2R, so that every subgroup has as much causal work as the others). The R ranks that hold the same
heads in the R subgroups form a ring. Each passes its k and v to the next one R-1 times, so that its queries meet
every share of the row, and computes attention against each share it holds:

* per block (this share's queries, one share's keys), the attention output and its log-sum-exp over those keys,
  masked causally by row position and within each sample (packed rows, the rows of a padded batch, the CP padding
  tail: a token attends only to earlier tokens of its own segment); blocks with nothing to attend are skipped;
* the partial outputs merged exactly by their log-sum-exp: out = sum_b exp(lse_b - lse) out_b, lse = logsumexp_b
  lse_b.

Backward is the flash-attention backward of each block given the merged output and log-sum-exp (exact: with the
merged log-sum-exp each block's probabilities are the true ones), with k and v passed around the ring again and
their gradients travelling with them, one hop more to reach their owner.

A block's kernel is a `BlockKernel`: `TORCH_KERNEL` (exact fp32 math in torch, tile by tile: `TILE` queries x
`TILE` keys of scores per head at a time; the sdpa and eager paths, any device) or flash-attn's varlen kernel with
its log-sum-exp (`ring_flash.FLASH_KERNEL`; the flash_attention_2 path and scripts' own flash-attn calls).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..collectives.order import new_token, ordered, remember_order, token_grad
from ..collectives.passes import PendingPass, start_pass
from ..collectives.record import site
from ..context import CPContext
from ..distributed import RingPeers
from ..settings import SETTINGS

NEG_INF = float("-inf")


KEYS, GRADIENTS = 0, 1  # the tags of the two rings of backward: keys and values, their gradients


def _pass_on(tensors: list[torch.Tensor], peers: RingPeers, overlap: bool, tag: int = KEYS) -> PendingPass:
    """Start sending `tensors` to the next member of the ring and receiving the previous member's (the same shapes);
    the caller computes, then waits (`PendingPass.wait`): with `overlap` the transfer runs behind that compute."""
    return start_pass(tensors, peers.group, peers.next_rank, peers.prev_rank, tag, peers.timeout, overlap)


def block_mask(q_pos: torch.Tensor, q_seg: torch.Tensor, k_pos: torch.Tensor, k_seg: torch.Tensor) -> torch.Tensor:
    """(Tq, Tk) bool: query i may attend key j — same segment, key not after the query in the row."""
    return (q_seg[:, None] == k_seg[None, :]) & (k_pos[None, :] <= q_pos[:, None])


def _expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


TILE = 512  # queries and keys per tile of a block: (TILE x TILE) scores per head is the block's working memory


@dataclass(frozen=True)
class Block:
    """One ring step's pairing: this member's queries against one member's keys, by row position and segment."""

    q_pos: torch.Tensor
    q_seg: torch.Tensor
    k_pos: torch.Tensor
    k_seg: torch.Tensor

    def tiles(self):
        """(query slice, key slice, allowed (tile, tile)) of each pair of tiles where some query may attend."""
        for q_start in range(0, self.q_pos.numel(), TILE):
            queries = slice(q_start, min(q_start + TILE, self.q_pos.numel()))
            for k_start in range(0, self.k_pos.numel(), TILE):
                keys = slice(k_start, min(k_start + TILE, self.k_pos.numel()))
                allowed = block_mask(self.q_pos[queries], self.q_seg[queries], self.k_pos[keys], self.k_seg[keys])
                if bool(allowed.any()):
                    yield queries, keys, allowed


def _scores(q, k, allowed, scale):
    return (torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale).masked_fill(~allowed, NEG_INF)


def torch_block(q, k, v, block: Block, scale):
    """Attention of q (B, H, Tq, D) over k, v (B, Hkv, Tk, D) where `block` allows it, tile by tile: (out fp32,
    lse (B, H, Tq)); a query with no key allowed gets out 0 and lse -inf. (None, None) when nothing is allowed."""
    k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    out = lse = None
    for queries, keys, allowed in block.tiles():
        if out is None:
            out = q.new_zeros(*q.shape, dtype=torch.float32)
            lse = q.new_full(q.shape[:-1], NEG_INF, dtype=torch.float32)
        scores = _scores(q[:, :, queries], k[:, :, keys], allowed.to(q.device), scale)
        tile_lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - tile_lse.masked_fill(tile_lse == NEG_INF, 0)[..., None])
        out[:, :, queries], lse[:, :, queries] = merge(out[:, :, queries], lse[:, :, queries],
                                                       torch.matmul(probs, v[:, :, keys].float()), tile_lse)
    return out, lse


def torch_block_backward(dout, q, k, v, out, lse, block: Block, scale):
    """Gradients (dq, dk, dv) fp32 of one block given the merged output and log-sum-exp (flash-attention's
    backward: with the merged log-sum-exp each tile's probabilities are the true ones)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    ke, ve = _expand_kv(k, heads).float(), _expand_kv(v, heads).float()
    dout = dout.float()
    delta = (dout * out.float()).sum(-1, keepdim=True)
    safe_lse = lse.masked_fill(lse == NEG_INF, 0)[..., None]
    dq = torch.zeros_like(q, dtype=torch.float32)
    dk, dv = torch.zeros_like(ke), torch.zeros_like(ve)
    for queries, keys, allowed in block.tiles():
        allowed = allowed.to(q.device)
        q_tile, do_tile = q[:, :, queries].float(), dout[:, :, queries]
        probs = torch.exp(_scores(q_tile, ke[:, :, keys], allowed, scale) - safe_lse[:, :, queries])
        probs = probs.masked_fill(~allowed, 0)
        dv[:, :, keys] += torch.matmul(probs.transpose(-1, -2), do_tile)
        dscores = probs * (torch.matmul(do_tile, ve[:, :, keys].transpose(-1, -2)) - delta[:, :, queries]) * scale
        dq[:, :, queries] += torch.matmul(dscores, ke[:, :, keys])
        dk[:, :, keys] += torch.matmul(dscores.transpose(-1, -2), q_tile)
    if kv_heads != heads:  # the gradient of a replicated KV head is the sum over its query group
        dk = dk.unflatten(1, (kv_heads, -1)).sum(2)
        dv = dv.unflatten(1, (kv_heads, -1)).sum(2)
    return dq, dk, dv


def merge(out, lse, block_out, block_lse):
    """Two partial attentions of the same queries over disjoint keys, merged exactly by their log-sum-exp."""
    if out is None:
        return block_out.float(), block_lse
    merged = torch.logaddexp(lse, block_lse)
    safe = merged.masked_fill(merged == NEG_INF, 0)
    weight_old = torch.exp(lse - safe).masked_fill(lse == NEG_INF, 0)[..., None]
    weight_new = torch.exp(block_lse - safe).masked_fill(block_lse == NEG_INF, 0)[..., None]
    return out * weight_old + block_out.float() * weight_new, merged


@dataclass(frozen=True)
class BlockKernel:
    """How one block is computed. `forward(q, k, v, block, scale)` -> (out fp32 (B, H, Tq, D), lse (B, H, Tq)), a
    query with no key allowed at out 0 and lse -inf, or (None, None) when the block allows nothing;
    `backward(dout, q, k, v, out, lse, block, scale)` -> (dq, dk, dv) fp32 given the merged out and lse, dk and dv
    with k's heads."""

    forward: Callable
    backward: Callable


TORCH_KERNEL = BlockKernel(forward=torch_block, backward=torch_block_backward)


@dataclass(frozen=True)
class Shares:
    """Row positions and segment ids of every ring member's tokens (`positions[i]`, `segments[i]`, each (T,))."""

    positions: list[torch.Tensor]
    segments: list[torch.Tensor]

    def block(self, mine: int, theirs: int) -> Block:
        return Block(self.positions[mine], self.segments[mine], self.positions[theirs], self.segments[theirs])


def ring_shares(ctx: CPContext) -> Shares:
    """Positions and segments of every ring member's share of the row: its subgroup's tokens, ascending."""
    positions = [ctx.split.subgroup_positions(g) for g in range(ctx.ring_size)]
    return Shares(positions=positions, segments=[ctx.segment_ids[p] for p in positions])


class _RingAttention(torch.autograd.Function):
    """Softmax attention of this member's queries over the whole ring's keys (module docstring). q (B, H, T, D); k,
    v (B, Hkv, T, D), every member's T the same. Ordered (`collectives/order.py`): every member passes k and v R-1
    times in forward and R times in backward, whatever its blocks hold; with `overlap` each pass runs behind a
    block's compute, in forward and backward alike."""

    @staticmethod
    def forward(ctx, q, k, v, shares: Shares, peers: RingPeers, scale: float, merge_fn, kernel: BlockKernel,
                overlap: bool, token):
        out = lse = None
        held_k, held_v = k, v
        for step in range(peers.size):
            owner = (peers.index - step) % peers.size
            # double buffer: the next step's keys travel while this step's are computed on
            incoming = _pass_on([held_k, held_v], peers, overlap) if step < peers.size - 1 else None
            block_out, block_lse = kernel.forward(q, held_k, held_v, shares.block(peers.index, owner), scale)
            if block_out is not None:
                out, lse = merge_fn(out, lse, block_out, block_lse)
            if incoming is not None:
                held_k, held_v = incoming.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.shares, ctx.peers, ctx.scale, ctx.kernel, ctx.overlap = shares, peers, scale, kernel, overlap
        remember_order(ctx, token)
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse, new_token(q)

    @staticmethod
    def backward(ctx, dout, dlse, grad_token):
        with site(ctx.site):
            return _RingAttention._backward(ctx, dout, grad_token)

    @staticmethod
    def _backward(ctx, dout, grad_token):
        """Two rings, each step's transfers behind its compute: the keys and values move on as in forward (posted
        before the block is computed), and the gradients of the keys a member holds follow one step behind — they
        arrive while it computes its block and leave, with its share added, for the next member, reaching their
        owner after R passes. Every member issues the same passes in the same order: keys 0, gradients 0, keys 1,
        gradients 1, ..., keys R-2, gradients R-2, gradients R-1.

        Only what an input needs runs (which inputs need a gradient follows from which parameters train, the same on
        every member): nothing when none does (a frozen layer), no gradient ring when only q does (LoRA on the query
        projection alone)."""
        q, k, v, out, lse = ctx.saved_tensors
        shares, peers, scale = ctx.shares, ctx.peers, ctx.scale
        want_q, want_kv = ctx.needs_input_grad[0], any(ctx.needs_input_grad[1:3])
        nothing = (None,) * 9
        if not (want_q or want_kv):
            return (*nothing, token_grad(ctx, grad_token))
        dq = torch.zeros_like(q, dtype=torch.float32) if want_q else None
        held_k, held_v = k, v
        held_dk = held_dv = None
        gradients = None  # the pass bringing the gradients of the keys held, summed over the members before
        for step in range(peers.size):
            owner = (peers.index - step) % peers.size
            incoming = _pass_on([held_k, held_v], peers, ctx.overlap) if step < peers.size - 1 else None
            dq_b, dk_b, dv_b = ctx.kernel.backward(dout, q, held_k, held_v, out, lse,
                                                   shares.block(peers.index, owner), scale)
            if want_q:
                dq += dq_b
            if want_kv:
                held_dk, held_dv = dk_b.float(), dv_b.float()
                if gradients is not None:
                    before_dk, before_dv = gradients.wait()
                    held_dk, held_dv = held_dk + before_dk, held_dv + before_dv
            if incoming is not None:
                held_k, held_v = incoming.wait()
            if want_kv and peers.size > 1:
                gradients = _pass_on([held_dk, held_dv], peers, ctx.overlap, GRADIENTS)
        if gradients is not None:  # the last pass brought this member's own keys' gradients back
            held_dk, held_dv = gradients.wait()
        grads = (None if dq is None else dq.to(q.dtype), None if held_dk is None else held_dk.to(k.dtype),
                 None if held_dv is None else held_dv.to(v.dtype))
        return (*grads, *nothing[3:], token_grad(ctx, grad_token))


def ring_attention(q, k, v, shares: Shares, peers: RingPeers, scale: float, merge_fn=merge,
                   kernel: BlockKernel = TORCH_KERNEL) -> torch.Tensor:
    """Attention of this ring member's queries (B, H, T, D) over every member's keys and values (B, Hkv, T, D):
    output (B, H, T, D), each block computed by `kernel`. `merge_fn` merges two partial attentions (the tests
    replace it to show that a wrong merge is caught). The passes' schedule (`SETTINGS.ring_overlap`) is read here,
    once per call: its forward and backward run alike."""
    return ordered(_RingAttention, q, k, v, shares, peers, scale, merge_fn, kernel, SETTINGS.ring_overlap)[0]
