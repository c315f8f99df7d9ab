"""Gated DeltaNet (Qwen3.5 linear attention) under CP, split by heads.

Sharding the sequence would restart the conv and the recurrent state at every shard edge. Instead,
like Ulysses for softmax attention, each rank takes the whole sequence for a share of the heads:

1. projections on the local tokens (q/k/v channels, z, the per-head gate inputs b and a);
2. all-to-all of q, k, v from sequence-sharded to head-sharded; all-gather of the small gate inputs
   (reduce-scattered in backward), then the gates beta and g of this rank's heads;
3. the depthwise causal conv on this rank's channels only, with the matching rows of the conv weight;
4. the gated delta rule for this rank's heads over the whole sequence, reset at every packed sample;
5. all-to-all back, then gated norm and output projection on the local tokens.

Key heads are replicated when there are fewer of them than ranks (each key head serves a group of
value heads; replication keeps the grouping exact). The conv and delta-rule functions are looked up
in the transformers modeling module at call time, so the flash-linear-attention / causal-conv1d
kernels are used when transformers selected them, and its pure-torch fallback otherwise.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from ..collectives import all_to_all, gather_reduce_scatter_grad
from ..context import CPContext
from .heads import kv_replication

SEQ, HEADS = 1, 2  # layout of per-head tensors here: (batch, seq, heads, dim)


def _takes_packed_sequences(fn) -> bool:
    """Whether transformers resolved `fn` to an optimized kernel (which accepts cu_seqlens / seq_idx).

    transformers' fallback wrapper keeps that decision in a closure variable; the pure-torch
    reference implementation rejects packed-sequence arguments, so anything else is treated as torch.
    """
    while fn is not None:
        code = getattr(fn, "__code__", None)
        if code is not None and "is_new_implementation" in code.co_freevars:
            return bool(fn.__closure__[code.co_freevars.index("is_new_implementation")].cell_contents)
        fn = getattr(fn, "__wrapped__", None)
    return False


def _local_conv_channels(layer, key_heads: list[int], value_heads: list[int]) -> torch.Tensor:
    """Indices of the conv channels (layout [q | k | v]) of the given key and value heads."""
    dk, dv, key_dim = layer.head_k_dim, layer.head_v_dim, layer.key_dim
    q = [h * dk + i for h in key_heads for i in range(dk)]
    k = [key_dim + c for c in q]
    v = [2 * key_dim + h * dv + i for h in value_heads for i in range(dv)]
    return torch.tensor(q + k + v, device=layer.conv1d.weight.device)


def _per_sample(fn, ctx: CPContext, seq_dim: int, *tensors, **kwargs):
    """Run `fn` once per sample along `seq_dim` (state resets at each start) and concatenate.

    The CP pad tail is left out and comes back as zeros: it lies after every real token, so it cannot
    change them, and leaving it out keeps the kernels' shapes (and rounding) those of P=1.
    """
    bounds = ctx.real_segments or [(0, ctx.seq_len)]
    outs = [fn(*(t.narrow(seq_dim, a, b - a) for t in tensors), **kwargs) for a, b in bounds]
    outs = [o[0] if isinstance(o, tuple) else o for o in outs]
    return ctx.pad(torch.cat(outs, dim=seq_dim) if len(outs) > 1 else outs[0], dim=seq_dim)


def gated_deltanet_over_cp(layer, hidden_states: torch.Tensor, ctx: CPContext) -> torch.Tensor:
    modeling = sys.modules[type(layer).__module__]
    group, size, rank = ctx.cp.group, ctx.cp.size, ctx.cp.rank
    num_k, num_v = layer.num_k_heads, layer.num_v_heads
    repeat = kv_replication(num_v, num_k, size, what=type(layer).__name__, names=("value", "key"))

    if ctx.padding_mask is not None:
        local_mask = ctx.padding_mask[:, ctx.local_slice].to(hidden_states.device)
        hidden_states = modeling.apply_mask_to_padding_states(hidden_states, local_mask)
    batch, local_len, _ = hidden_states.shape

    mixed = layer.in_proj_qkv(hidden_states)
    z = layer.in_proj_z(hidden_states).reshape(batch, local_len, -1, layer.head_v_dim)
    b, a = layer.in_proj_b(hidden_states), layer.in_proj_a(hidden_states)

    q, k, v = torch.split(mixed, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    q = q.reshape(batch, local_len, num_k, layer.head_k_dim)
    k = k.reshape(batch, local_len, num_k, layer.head_k_dim)
    v = v.reshape(batch, local_len, num_v, layer.head_v_dim)
    if repeat > 1:
        q, k = q.repeat_interleave(repeat, dim=HEADS), k.repeat_interleave(repeat, dim=HEADS)
    q, k, v = (all_to_all(t, HEADS, SEQ, group, size) for t in (q, k, v))
    b, a = (gather_reduce_scatter_grad(t, SEQ, group, size, rank) for t in (b, a))

    # This rank's heads: replicated key heads map back to the original head index // repeat.
    keys_here = (num_k * repeat) // size
    values_here = num_v // size
    key_heads = [h // repeat for h in range(rank * keys_here, (rank + 1) * keys_here)]
    value_heads = list(range(rank * values_here, (rank + 1) * values_here))

    # The gates over the whole sequence for all heads, computed exactly as stock does (same shapes, so
    # the same rounding; the inputs are only 2 x value-heads numbers per token), then this rank's heads.
    # A_log and dt_bias thus accumulate their gradient in one reduction over the sequence, like P=1.
    heads = slice(value_heads[0], value_heads[-1] + 1)
    b, a = b.narrow(SEQ, 0, ctx.seq_len), a.narrow(SEQ, 0, ctx.seq_len)
    beta = ctx.pad(b.sigmoid()[..., heads], dim=SEQ)
    g = ctx.pad((-layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias))[..., heads], dim=SEQ)
    channels = _local_conv_channels(layer, key_heads, value_heads)
    weight = layer.conv1d.weight.squeeze(1)[channels]
    bias = None if layer.conv1d.bias is None else layer.conv1d.bias[channels]

    seq = q.shape[SEQ]
    mixed = torch.cat([t.reshape(batch, seq, -1) for t in (q, k, v)], dim=-1).transpose(1, 2)
    conv = modeling.causal_conv1d_fn
    if ctx.segments is not None and _takes_packed_sequences(conv):
        seq_idx = torch.repeat_interleave(
            torch.arange(len(ctx.segments), device=mixed.device, dtype=torch.int32),
            torch.tensor([b - a for a, b in ctx.segments], device=mixed.device),
        )[None]
        mixed = conv(mixed, weight, bias, activation=layer.activation, seq_idx=seq_idx)
    else:
        mixed = _per_sample(conv, ctx, 2, mixed, weight=weight, bias=bias, activation=layer.activation)
    mixed = mixed.transpose(1, 2)
    local_key_dim = keys_here * layer.head_k_dim
    q, k, v = torch.split(mixed, [local_key_dim, local_key_dim, values_here * layer.head_v_dim], dim=-1)
    q = q.reshape(batch, seq, keys_here, layer.head_k_dim)
    k = k.reshape(batch, seq, keys_here, layer.head_k_dim)
    v = v.reshape(batch, seq, values_here, layer.head_v_dim)

    rule = modeling.torch_chunk_gated_delta_rule
    options = dict(initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True)
    if ctx.segments is not None and _takes_packed_sequences(rule):
        out, _ = rule(q, k, v, g=g, beta=beta, cu_seqlens=ctx.cu_seqlens.to(q.device).long(), **options)
    else:
        out = _per_sample(lambda q, k, v, g, beta: rule(q, k, v, g=g, beta=beta, **options), ctx, SEQ, q, k, v, g, beta)

    out = all_to_all(out, SEQ, HEADS, group, size)  # (batch, local_len, num_v, head_v_dim)
    ctx.exchanges["linear_attention"] += 6  # q, k, v, out all-to-all; b, a all-gather
    out = layer.norm(out.reshape(-1, layer.head_v_dim), z.reshape(-1, layer.head_v_dim))
    return layer.out_proj(out.reshape(batch, local_len, -1))
