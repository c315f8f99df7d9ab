"""The ring's block kernel on flash-attn's varlen kernel: the flash_attention_2 path (and a script's own flash-attn
calls) across a ring, for CP sizes beyond the heads.

A block pairs this member's queries with one member's keys (`ring.Block`). In the zigzag layout each side is made of
runs of consecutive row positions (its two chunks, one run where they touch), so a block falls into pieces, one per
(query run, key run):

* the same run (a member's own chunks, the ring's first step): causal attention within each segment of the run —
  one varlen call with the run's segment boundaries, as the kernel runs on a whole row;
* a key run wholly before the query run: only a segment that straddles them (a sample that ends the key run and
  begins the query run) attends across, and its queries see every one of its keys there — one non-causal call on
  those tokens;
* a key run after the query run: nothing.

Forward calls flash-attn's public `flash_attn_varlen_func` with `return_attn_probs=True` for each piece's output and
log-sum-exp (heads, tokens), merged by `ring.merge`. Backward calls flash-attn's `_flash_attn_varlen_backward` with
the merged output and log-sum-exp, which gives each piece its true gradients (as `ring.torch_block_backward` does).
That function is internal to flash-attn, and its keywords changed within 2.x (one `window_size` pair, later
`window_size_left` / `window_size_right` and `softcap`): the call passes, by name, what its signature has
(`_backward_arguments`).

Pieces work on one row: B = 1, as the CP decoder lays its batch out.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass

import torch

from ..errors import UnsupportedSetupError
from .ring import NEG_INF, Block, BlockKernel, merge

INTERFACE = "flash_attn.flash_attn_interface"


@dataclass(frozen=True)
class Piece:
    """Queries `queries` (indices into this member's tokens) over keys `keys` (into the other member's), with the
    cumulative sequence lengths of each side's sequences in the call."""

    queries: slice
    keys: slice
    causal: bool
    cu_q: tuple[int, ...]
    cu_k: tuple[int, ...]


def _runs(positions: list[int]) -> list[tuple[int, int]]:
    """Index ranges [a, b) of consecutive row positions."""
    starts = [0] + [i for i in range(1, len(positions)) if positions[i] != positions[i - 1] + 1]
    return list(zip(starts, starts[1:] + [len(positions)]))


def _segment_edges(segments: list[int], a: int, b: int) -> tuple[int, ...]:
    """Cumulative lengths of the segments within [a, b), relative to a."""
    return (0, *(i - a for i in range(a + 1, b) if segments[i] != segments[i - 1]), b - a)


def block_pieces(block: Block) -> list[Piece]:
    """The varlen calls that compute `block` (module docstring)."""
    q_pos, q_seg, k_pos, k_seg = (t.tolist() for t in (block.q_pos, block.q_seg, block.k_pos, block.k_seg))
    pieces = []
    for qa, qb in _runs(q_pos):
        for ka, kb in _runs(k_pos):
            if k_pos[ka] == q_pos[qa] and kb - ka == qb - qa:
                edges = _segment_edges(q_seg, qa, qb)
                pieces.append(Piece(slice(qa, qb), slice(ka, kb), True, edges, edges))
            elif k_pos[kb - 1] < q_pos[qa]:
                if k_seg[kb - 1] != q_seg[qa]:
                    continue
                q_end, k_start = qa, kb
                while q_end < qb and q_seg[q_end] == q_seg[qa]:
                    q_end += 1
                while k_start > ka and k_seg[k_start - 1] == q_seg[qa]:
                    k_start -= 1
                pieces.append(Piece(slice(qa, q_end), slice(k_start, kb), False, (0, q_end - qa), (0, kb - k_start)))
            elif k_pos[ka] <= q_pos[qb - 1]:
                raise ValueError("ring blocks pair disjoint or identical runs of positions")
    return pieces


@functools.cache
def _kernels():
    """flash-attn's original varlen forward (not the package's wrapper) and its internal varlen backward."""
    interface = importlib.import_module(INTERFACE)
    forward = interface.flash_attn_varlen_func
    return getattr(forward, "vlmcp_original", forward), interface._flash_attn_varlen_backward


def _thd(t: torch.Tensor) -> torch.Tensor:
    """(1, H, T, D) -> (T, H, D), as the varlen kernel takes it."""
    return t[0].transpose(0, 1).contiguous()


def _lengths(piece: Piece, device) -> dict:
    cu_q, cu_k = (torch.tensor(cu, dtype=torch.int32, device=device) for cu in (piece.cu_q, piece.cu_k))
    return {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k,
            "max_seqlen_q": max(b - a for a, b in zip(piece.cu_q, piece.cu_q[1:])),
            "max_seqlen_k": max(b - a for a, b in zip(piece.cu_k, piece.cu_k[1:]))}


def flash_block(q, k, v, block: Block, scale: float):
    """`BlockKernel.forward` on flash-attn: q (1, H, Tq, D), k, v (1, Hkv, Tk, D)."""
    if q.shape[0] != 1:
        raise UnsupportedSetupError(f"the ring's flash-attn kernel runs one packed row; it got {q.shape[0]} rows")
    pieces = block_pieces(block)
    if not pieces:
        return None, None
    varlen, _ = _kernels()
    q3, k3, v3 = _thd(q), _thd(k), _thd(v)
    out = q.new_zeros(*q.shape, dtype=torch.float32)
    lse = q.new_full(q.shape[:-1], NEG_INF, dtype=torch.float32)
    for piece in pieces:
        rows = piece.queries
        result = varlen(q3[rows], k3[piece.keys], v3[piece.keys], **_lengths(piece, q.device), softmax_scale=scale,
                        causal=piece.causal, return_attn_probs=True)
        piece_out, piece_lse = result[0], result[1]
        if piece_lse.shape != (q.shape[1], rows.stop - rows.start):
            raise UnsupportedSetupError(f"flash-attn returned a log-sum-exp of shape {tuple(piece_lse.shape)} for a "
                                        f"varlen call; the ring needs (heads, tokens) (flash-attn 2.4 or later)")
        out[0, :, rows], lse[0, :, rows] = merge(out[0, :, rows], lse[0, :, rows],
                                                 piece_out.transpose(0, 1), piece_lse.float())
    return out, lse


def _backward_arguments(backward, given: dict) -> dict:
    """Keyword arguments for flash-attn's `_flash_attn_varlen_backward`: `given` plus no window, no softcap, no
    dropout, no ALiBi, under the names its signature uses."""
    params = inspect.signature(backward).parameters
    defaults = {"dropout_p": 0.0, "window_size": (-1, -1), "window_size_left": -1, "window_size_right": -1,
                "softcap": 0.0, "alibi_slopes": None, "deterministic": False, "rng_state": None}
    arguments = {name: value for name, value in {**defaults, **given}.items() if name in params}
    missing = [name for name, p in params.items() if p.default is inspect.Parameter.empty and name not in arguments]
    if missing:
        raise UnsupportedSetupError(f"flash-attn's _flash_attn_varlen_backward takes {missing}, which the ring does "
                                    f"not know; install a flash-attn 2 release the package lists (docs/versions.md)")
    return arguments


def flash_block_backward(dout, q, k, v, out, lse, block: Block, scale: float):
    """`BlockKernel.backward` on flash-attn, given the merged out (1, H, Tq, D) and lse (1, H, Tq)."""
    _, backward = _kernels()
    q3, k3, v3, dout3, out3 = _thd(q), _thd(k), _thd(v), _thd(dout.to(q.dtype)), _thd(out.to(q.dtype))
    dq = torch.zeros_like(q, dtype=torch.float32)
    dk, dv = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
    for piece in block_pieces(block):
        rows, keys = piece.queries, piece.keys
        grads = {"dq": torch.empty_like(q3[rows]), "dk": torch.empty_like(k3[keys]), "dv": torch.empty_like(v3[keys])}
        given = {"dout": dout3[rows], "q": q3[rows], "k": k3[keys], "v": v3[keys], "out": out3[rows],
                 "softmax_lse": lse[0, :, rows].contiguous(), **grads, **_lengths(piece, q.device),
                 "softmax_scale": scale, "causal": piece.causal}
        backward(**_backward_arguments(backward, given))
        dq[0, :, rows] += grads["dq"].transpose(0, 1).float()
        dk[0, :, keys] += grads["dk"].transpose(0, 1).float()
        dv[0, :, keys] += grads["dv"].transpose(0, 1).float()
    return dq, dk, dv


FLASH_KERNEL = BlockKernel(forward=flash_block, backward=flash_block_backward)
