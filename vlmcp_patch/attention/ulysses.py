"""Ulysses all-to-all around transformers' `sdpa` and `flash_attention_2` attention functions.

The wrappers are registered in transformers' attention registry in place of the stock entries. They
act only when a call carries the `vlmcp_ctx` keyword, which the patched text decoder adds under CP (and
the vision tower when it encodes slices of the patches, `forward/vision.py`); every other caller (models
we do not patch, CP off) reaches the stock function unchanged.

Under CP a decoder layer holds q/k/v for its local slice of the sequence and all heads. The exchange
turns them into the whole sequence for H/P heads, runs the stock kernel with the *global* sample
boundaries, and turns the output back.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..collectives.differentiable import all_to_all
from ..collectives.order import run_ordered
from ..collectives.record import module_site, site
from ..context import CTX_KWARG, CPContext
from ..distributed import cp_requested
from ..errors import UnsupportedSetupError
from ..patching import cp_size
from ..settings import SETTINGS
from ..supported import unsupported_model_message
from .foreign import kernel_on_whole_sequence, record_exchange
from .head_chunks import ChunkPlan, by_head_chunks, chunk_heads, chunk_kv_heads, head_chunk_problem
from .heads import BHSD, BSHD, kv_replication
from .ring import TORCH_KERNEL, ring_attention, ring_shares
from .ring_flash import FLASH_KERNEL

# Keyword arguments that describe the *local* sequence; under CP the global ones replace them.
_LOCAL_SEQUENCE_KWARGS = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


class _LocalHeads:
    """A view of an attention module with the KV grouping of this rank's share of the heads."""

    def __init__(self, module: torch.nn.Module, num_key_value_groups: int):
        self._module = module
        self.num_key_value_groups = num_key_value_groups

    def __getattr__(self, name):
        return getattr(self._module, name)


def _sdpa_global(original, module, q, k, v, ctx: CPContext, kwargs):
    # One call per sample of the row (per image for the vision tower): no (S x S) mask is ever built.
    causal = getattr(module, "is_causal", True)
    outs = [
        original(module, q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], None, **{**kwargs, "is_causal": causal})[0]
        for a, b in ctx.attention_segments
    ]
    return torch.cat(outs, dim=BSHD.seq)


def _flash_global(original, module, q, k, v, ctx: CPContext, kwargs):
    cu = ctx.cu_seqlens(q.device)
    longest = ctx.max_segment_len
    kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    return original(module, q, k, v, None, **kwargs)[0]


_GLOBAL_CALL = {"sdpa": _sdpa_global, "flash": _flash_global}
_RING_KERNEL = {"sdpa": TORCH_KERNEL, "flash": FLASH_KERNEL}


def _ring_call(module, q, k, v, ctx: CPContext, flavor: str, kwargs) -> torch.Tensor:
    """Attention of this subgroup's share of the row over the whole row, around the ring (`ring.py`), each block on
    the flavor's kernel: q, k, v (B, H/U, T, D) -> (B, T, H/U, D)."""
    if kwargs.get("dropout"):
        raise UnsupportedSetupError("attention dropout cannot run across a CP ring (P beyond the heads); set the "
                                    "model's attention_dropout to 0 or choose a CP size that divides the heads")
    scale = kwargs.get("scaling") or q.shape[-1] ** -0.5
    return ring_attention(q, k, v, ring_shares(ctx), ctx.groups.ring, scale,
                          kernel=_RING_KERNEL[flavor]).transpose(1, 2)


def attention_over_cp(original, flavor: str, module, query, key, value, ctx: CPContext, kwargs) -> torch.Tensor:
    """Attention of this rank's slice: q/k/v (B, H, S/P, D) for all heads -> the subgroup's share of the row (the
    whole row when U = P) for H/U heads -> the stock kernel with the row's sample boundaries, or the ring across the
    subgroups -> output (B, S/P, H, D) for all heads again. With head chunks (`SETTINGS.head_chunks` > 1) the same,
    one chunk of the H/U heads at a time (`head_chunks.py`)."""
    chunks = SETTINGS.head_chunks
    if chunks > 1 and not getattr(module, "is_causal", True):
        # the vision tower's attention: as many of the chunks as its heads allow (the count is checked against the
        # decoder's query heads, before any compute)
        heads, size = query.shape[BHSD.heads], ctx.groups.ulysses.size
        chunks = math.gcd(chunks, heads // size) if heads % size == 0 else 1
    if chunks > 1:
        return _attention_by_head_chunks(original, flavor, module, query, key, value, ctx, kwargs, chunks)
    ulysses = ctx.groups.ulysses
    group, size = ulysses.group, ulysses.size
    num_heads, num_kv = query.shape[BHSD.heads], key.shape[BHSD.heads]
    repeat = kv_replication(num_heads, num_kv, size, what=type(module).__name__)
    if repeat > 1:
        key = key.repeat_interleave(repeat, dim=BHSD.heads)
        value = value.repeat_interleave(repeat, dim=BHSD.heads)
    q, k, v = (all_to_all(t, BHSD.heads, BHSD.seq, group, size) for t in (query, key, value))
    local = _LocalHeads(module, q.shape[BHSD.heads] // k.shape[BHSD.heads])
    for name in _LOCAL_SEQUENCE_KWARGS:
        kwargs.pop(name, None)
    with kernel_on_whole_sequence():
        if ctx.contiguous:
            out = _GLOBAL_CALL[flavor](original, local, q, k, v, ctx, kwargs)  # (B, S, H/P, D)
        else:
            out = _ring_call(local, q, k, v, ctx, flavor, kwargs)  # (B, S/R, H/U, D)
    record_exchange(ctx)
    return all_to_all(out, BSHD.seq, BSHD.heads, group, size)  # (B, S/P, H, D)


def _attention_by_head_chunks(original, flavor: str, module, query, key, value, ctx: CPContext, kwargs,
                              chunks: int) -> torch.Tensor:
    """`attention_over_cp` by `chunks` chunks of this rank's heads: chunk c exchanges the heads of virtual rank
    r * chunks + c of a Ulysses layout of U x chunks ranks (`head_chunks.chunk_heads`), their key/value heads with
    them, runs the kernel (or the ring) on them and exchanges its output back into those heads."""
    ulysses = ctx.groups.ulysses
    group, size = ulysses.group, ulysses.size
    num_heads, num_kv = query.shape[BHSD.heads], key.shape[BHSD.heads]
    what = type(module).__name__
    kv_replication(num_heads, num_kv, size, what=what)  # the layout's own refusals first
    problem = head_chunk_problem(num_heads, size, chunks, what=what)
    if problem is not None:
        raise UnsupportedSetupError(problem)
    if kwargs.get("dropout"):
        raise UnsupportedSetupError(f"{what}: attention dropout cannot run by head chunks (VLMCP_HEAD_CHUNKS="
                                    f"{chunks}; the backward recomputes each chunk); set the model's "
                                    "attention_dropout to 0 or VLMCP_HEAD_CHUNKS=1")
    for name in _LOCAL_SEQUENCE_KWARGS:
        kwargs.pop(name, None)

    def chunk(q, k, v):  # (B, U * h, S/P, D) -> (B, S/P, U * h, D), h = H / (U * chunks)
        q, k, v = (all_to_all(t, BHSD.heads, BHSD.seq, group, size) for t in (q, k, v))
        local = _LocalHeads(module, q.shape[BHSD.heads] // k.shape[BHSD.heads])
        with kernel_on_whole_sequence():
            if ctx.contiguous:
                out = _GLOBAL_CALL[flavor](original, local, q, k, v, ctx, dict(kwargs))
            else:
                out = _ring_call(local, q, k, v, ctx, flavor, dict(kwargs))
        return all_to_all(out, BSHD.seq, BSHD.heads, group, size)

    heads = chunk_heads(num_heads, size, chunks)
    kv_heads = chunk_kv_heads(num_heads, num_kv, size, chunks)
    plan = ChunkPlan(run=chunk, inputs=((BHSD.heads, heads), (BHSD.heads, kv_heads), (BHSD.heads, kv_heads)),
                     output=(BSHD.heads, heads))
    out = by_head_chunks(plan, query, key, value)
    record_exchange(ctx)
    return out


def ulysses_attention(original: Callable, flavor: str) -> Callable:
    """Wrap a registry attention function so decoder calls under CP go through the Ulysses exchange."""

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        ctx = kwargs.pop(CTX_KWARG, None)
        if ctx is None:
            if getattr(module, "is_causal", False) and cp_requested():
                # A causal decoder that did not come through a patched top-level forward would
                # silently run the whole sequence on every rank.
                what = f"{type(module).__name__} (a decoder attention)"
                raise UnsupportedSetupError(unsupported_model_message(what, cp_size()))
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        if args:
            raise TypeError("vlmcp_patch: attention functions are called with keyword arguments after the mask")
        with site(module_site(module)):
            return run_ordered(attention_over_cp, original, flavor, module, query, key, value, ctx, kwargs), None

    attention.__name__ = f"vlmcp_ulysses_{getattr(original, '__name__', flavor)}"
    attention.__wrapped__ = original
    attention.vlmcp_original = original
    return attention
