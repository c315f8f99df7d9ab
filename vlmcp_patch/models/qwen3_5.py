"""Qwen3.5 and Qwen3.5-MoE: the shared CP forward, plus the gated DeltaNet layers split by heads.

Sharding the sequence would restart the DeltaNet conv and recurrent state at every shard edge. Instead,
like Ulysses for softmax attention, each rank takes the whole sequence for a share of the heads:

1. projections on the local tokens (q/k/v channels, z, the per-head gate inputs b and a);
2. all-to-all of q, k, v and the gate inputs from sequence-sharded to head-sharded, then the gates beta and g
   of this rank's heads;
3. the depthwise causal conv on this rank's channels only, with the matching rows of the conv weight;
4. the gated delta rule for this rank's heads over the whole row, reset at every packed sample;
5. all-to-all back, then gated norm and output projection on the local tokens.

Key heads are replicated when there are fewer of them than ranks (each key head serves a group of
value heads; replication keeps the grouping exact). The conv and delta-rule functions are looked up
in the transformers modeling module at call time, so the flash-linear-attention / causal-conv1d
kernels are used when transformers selected them, and its pure-torch fallback otherwise.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..attention.heads import BSHD, kv_replication
from ..collectives.differentiable import all_to_all
from ..collectives.order import run_ordered
from ..collectives.record import module_site, site
from ..context import CTX_KWARG, CPContext
from ..forward.arguments import call_arguments
from ..offload import foreign_offload_problem
from ..patching import Patch, source_digest
from ..supported import Family, register
from .base import ImageFeatures, MLPs, family_patches, mlp_patches, norm_patches, offload_patches
from .deltanet_ring import conv_over_ring, delta_rule_over_ring


def _deltanet_class(family: Family) -> type:
    prefix = family.text_model.removesuffix("TextModel")
    return getattr(importlib.import_module(family.module), f"{prefix}GatedDeltaNet")


def _replaced_forward(module: torch.nn.Module):
    """The forward `kernels.kernelize` bound on `module` in place of its class's (a hub kernel); None where the
    module runs its class's forward (kernelize's own fallback binds that one, which is no replacement)."""
    bound = vars(module).get("forward")
    return bound if bound is not None and getattr(bound, "__func__", None) is not type(module).forward else None


def kernelized_layer_problem(model) -> str | None:
    """On the package's path (under CP, a packed row at P=1), a DeltaNet layer whose forward was replaced on the
    module itself, the way `kernels.kernelize` installs a hub kernel (`module.forward = MethodType(kernel.forward,
    module)`): that forward would bypass the class's (patched) forward and run the layer on this rank's slice alone,
    through the samples of a packed row. Refused, saying how to run. With CP off an ordinary batch never gets here:
    the kernel runs as on stock.

    kernelize's own fallback binds the class's forward as it is then: with the package applied that is the CP
    path, so it passes. The functions kernelize may replace (`causal_conv1d_fn`, the delta-rule functions) keep
    their stock signatures and are called by the CP path itself per sample (or with packed-sequence arguments
    where they are transformers' kernel wrappers): they run exactly. `causal_conv1d_forward` (5.25+) is not on
    the CP path at all.
    """
    classes = tuple(_deltanet_class(family) for family in FAMILIES)
    for name, module in model.named_modules():
        bound = _replaced_forward(module) if isinstance(module, classes) else None
        if bound is not None:
            return (
                f"the gated DeltaNet layer {name} ({type(module).__name__}) runs a forward replaced on the module "
                f"({getattr(bound, '__qualname__', bound)}), as `kernels.kernelize` installs a hub kernel "
                "(`model.kernelize()`, `from_pretrained(..., use_kernels=True)`); under CP it would run on this "
                "rank's slice of the row alone, and at P=1 through the samples of a packed row. To run CP or packed "
                "rows, don't kernelize the model (the package's path uses the "
                "flash-linear-attention and causal-conv1d kernels by itself where they are installed), or give "
                "kernelize a `KernelConfig` / mapping without `Qwen3_5GatedDeltaNet`, or restore the class's "
                "forward with `del layer.forward` on each such layer; or set VLMCP_CP_SIZE=1."
            )
    return None


def cp_problem(model) -> str | None:
    """What Qwen3.5 cannot run on the package's path: a kernelized DeltaNet layer, or checkpoint offload that is not
    the package's (`offload.foreign_offload_problem`)."""
    return kernelized_layer_problem(model) or foreign_offload_problem(model)


FAMILIES = register(
    Family(
        "qwen3_5", ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"), "Qwen3_5TextModel", "Qwen3_5Model",
        "Qwen3_5VisionModel", cp_check=cp_problem,
    ),
    Family(
        "qwen3_5_moe", ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"), "Qwen3_5MoeTextModel",
        "Qwen3_5MoeModel", "Qwen3_5MoeVisionModel", cp_check=cp_problem,
    ),
)
TEXT_MODEL_PARAMS = ("input_ids", "inputs_embeds", "position_ids", "attention_mask", "use_cache")
# Digests of the upstream Qwen3_5GatedDeltaNet.forward that `gated_deltanet_over_cp` re-implements (the same in
# the MoE module), with the releases each was checked on. A digest not listed means upstream changed the layer:
# re-check it. Between them only the cache handling (not used under CP) differs, where the conv and rule functions
# live (`FORWARD_KEEPS_KERNELS_ON_LAYER`), whether the forward takes keyword arguments (5.9 on; before, the CP
# context comes through `context_for_linear_attention`), and where q and k are repeated
# to the value heads: in the layer's forward before the delta rule up to 5.22, inside the rule functions from
# 5.23 (grouped value attention). 5.25 moved the conv into a module-level `causal_conv1d_forward` (the same conv
# without a cache) and lets the chunked rule leave `cache.get_recurrent_states_to_keep` trailing tokens to the
# recurrent rule (none without a cache): under CP (no cache) the layer computes what it did in 5.24. The CP path
# calls `causal_conv1d_fn` and the rule functions itself, never `causal_conv1d_forward`, so a kernel that
# `kernels.kernelize` puts in place of that one is not on the CP path (`kernelized_layer_problem`: why the others
# run).
GATED_DELTANET_FORWARD = {
    "a72326938da48c9d": "transformers>=5.2,<5.4",  # Qwen3_5GatedDeltaNet
    "8f101be70342a885": "transformers>=5.2,<5.4",  # Qwen3_5MoeGatedDeltaNet (its own cache class in the annotation)
    "f345f469bbbbc327": "transformers>=5.4,<5.5",  # Qwen3_5GatedDeltaNet
    "229e5a869adc5b6b": "transformers>=5.4,<5.5",  # Qwen3_5MoeGatedDeltaNet
    "7c437c5a9ee098ed": "transformers>=5.5,<5.7",
    "6da7baea4e4fc44f": "transformers>=5.7,<5.9",
    "fb880bc880960988": "transformers>=5.9,<5.13",
    "bec9939210bcf590": "transformers>=5.13,<5.14",
    "b4550a244115aff2": "transformers>=5.14,<5.15",
    "986d09de2ac78f97": "transformers>=5.15,<5.16",
    "bd25761e1031fff0": "transformers>=5.16,<5.21",
    "43718d6c3e7255e6": "transformers>=5.21,<5.23",
    "8f31ae7d35daf534": "transformers>=5.23,<5.24",
    "08cf65a63ca582a2": "transformers>=5.24,<5.25",
    "a43ffe9ab7f49c75": "transformers>=5.25,<5.26",
}
# Up to 5.14 the layer keeps its kernels on itself (`causal_conv1d_fn`: causal-conv1d's or None, then stock runs
# its nn.Conv1d and SiLU; `chunk_gated_delta_rule`: flash-linear-attention's or the module's
# `torch_chunk_gated_delta_rule`); from 5.15 it calls the module's functions, transformers' kernel wrappers with
# their torch fallback. The CP path calls what the installed layer calls (`_conv_function`, `_rule_function`).
FORWARD_KEEPS_KERNELS_ON_LAYER = {
    "a72326938da48c9d", "8f101be70342a885", "f345f469bbbbc327", "229e5a869adc5b6b", "7c437c5a9ee098ed",
    "6da7baea4e4fc44f", "fb880bc880960988", "bec9939210bcf590", "b4550a244115aff2",
}
# From 5.9 the decoder layer passes its keyword arguments (the CP context among them) on to the gated DeltaNet layer,
# whose forward takes them; up to 5.8 neither, and the context reaches the DeltaNet layer through
# `context_for_linear_attention`, a patch of the decoder layer's forward declared for those releases only.
KWARGS_STOP_AT_DECODER_LAYER = "transformers<5.9"
FORWARD_REPEATS_KEY_HEADS = FORWARD_KEEPS_KERNELS_ON_LAYER | {"986d09de2ac78f97", "bd25761e1031fff0", "43718d6c3e7255e6"}
# Digests of the upstream Qwen3_5Model.get_image_features (the same in the MoE module) that the CP path replaces
# (`forward/vision.py`), with the releases each was checked on.
IMAGE_FEATURES = ImageFeatures(digests={
    "8bbb265e453e14c1": "transformers>=5.2,<5.9",
    "089a69edc1e434e9": "transformers>=5.9,<5.15",
    "6727c329a5f160b1": "transformers>=5.15,<5.18",
    "f025aaaa71a69cd7": "transformers>=5.18,<5.23",
    "70b336d6aa3c2cfd": "transformers>=5.23,<5.26",
})


def _closure_value(fn, name: str, default=None):
    code = getattr(fn, "__code__", None)
    if code is None or name not in code.co_freevars:
        return default
    return fn.__closure__[code.co_freevars.index(name)].cell_contents


def _takes_packed_sequences(fn, device: torch.device) -> bool:
    """Whether transformers resolved `fn` to an optimized kernel that accepts cu_seqlens / seq_idx on `device`.

    transformers' fallback wrapper keeps that decision in closure variables (`is_new_implementation`; from 5.25
    also `supported_devices`: a kernel package's devices, others taking the torch path). With `kernels` installed
    the wrapper is the `forward` of a function module (`use_kernel_forward_from_hub` on a function); one whose
    forward `kernelize` replaced by a hub kernel is called per sample, with the stock signature. The pure-torch
    reference rejects packed-sequence arguments, so anything else is treated as torch.
    """
    if isinstance(fn, torch.nn.Module):
        if _replaced_forward(fn) is not None:
            return False  # a hub kernel: only the stock signature is known
        fn = _closure_value(type(fn).forward, "func")
    while fn is not None:
        if _closure_value(fn, "is_new_implementation") is not None:
            devices = _closure_value(fn, "supported_devices")
            on_device = devices is None or device.type in devices
            return bool(_closure_value(fn, "is_new_implementation")) and on_device
        fn = getattr(fn, "__wrapped__", None)
    return False


def _local_conv_channels(layer, key_heads: list[int], value_heads: list[int]) -> torch.Tensor:
    """Indices of the conv channels (layout [q | k | v]) of the given key and value heads."""
    device = layer.conv1d.weight.device
    dk, dv, key_dim = layer.head_k_dim, layer.head_v_dim, layer.key_dim
    q = (torch.tensor(key_heads, device=device)[:, None] * dk + torch.arange(dk, device=device)).flatten()
    v = (torch.tensor(value_heads, device=device)[:, None] * dv + torch.arange(dv, device=device)).flatten()
    return torch.cat([q, key_dim + q, 2 * key_dim + v])


def _per_sample(fn, ctx: CPContext, seq_dim: int, *tensors, **kwargs):
    """Run `fn` once per sample along `seq_dim` (state resets at each start) and concatenate.

    The CP pad tail is left out and comes back as zeros: it lies after every real token, so it cannot
    change them, and leaving it out keeps the kernels' shapes (and rounding) those of P=1.
    """
    outs = [fn(*(t.narrow(seq_dim, a, b - a) for t in tensors), **kwargs) for a, b in ctx.segments]
    outs = [o[0] if isinstance(o, tuple) else o for o in outs]
    return ctx.pad(torch.cat(outs, dim=seq_dim) if len(outs) > 1 else outs[0], dim=seq_dim)


@dataclass(frozen=True)
class _HeadShare:
    """The DeltaNet heads of one rank: key heads (after replication) and value heads."""

    repeat: int  # each key head is repeated this many times so that P divides them
    key_heads: list[int]  # original index of each local key head
    value_heads: list[int]

    @classmethod
    def of(cls, layer, ctx: CPContext) -> _HeadShare:
        size, rank = ctx.groups.ulysses.size, ctx.groups.ulysses.rank
        repeat = kv_replication(layer.num_v_heads, layer.num_k_heads, size, type(layer).__name__, ("value", "key"))
        keys, values = layer.num_k_heads * repeat // size, layer.num_v_heads // size
        return cls(
            repeat=repeat,
            key_heads=[h // repeat for h in range(rank * keys, (rank + 1) * keys)],
            value_heads=list(range(rank * values, (rank + 1) * values)),
        )


def _heads_over_whole_sequence(layer, mixed: torch.Tensor, share: _HeadShare, ctx: CPContext):
    """Local tokens x all heads -> whole sequence x this rank's heads, for q, k and v."""
    batch, local_len, _ = mixed.shape
    q, k, v = torch.split(mixed, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    q = q.reshape(batch, local_len, layer.num_k_heads, layer.head_k_dim)
    k = k.reshape(batch, local_len, layer.num_k_heads, layer.head_k_dim)
    v = v.reshape(batch, local_len, layer.num_v_heads, layer.head_v_dim)
    if share.repeat > 1:
        q, k = q.repeat_interleave(share.repeat, dim=BSHD.heads), k.repeat_interleave(share.repeat, dim=BSHD.heads)
    ulysses = ctx.groups.ulysses
    return tuple(all_to_all(t, BSHD.heads, BSHD.seq, ulysses.group, ulysses.size) for t in (q, k, v))


def _gates(layer, b: torch.Tensor, a: torch.Tensor, share: _HeadShare, ctx: CPContext):
    """beta and g of this rank's heads over the whole (padded) sequence.

    The gate inputs (one number per value head and token each) take the same exchange as q, k and v: sequence
    for heads, so only this rank's heads of them are ever held. Per element the arithmetic is stock's, and
    A_log and dt_bias still accumulate each head's gradient in one reduction over the whole sequence, on the
    rank that holds the head.
    """
    heads = slice(share.value_heads[0], share.value_heads[-1] + 1)
    b, a = (all_to_all(t, BSHD.heads, BSHD.seq, ctx.groups.ulysses.group, ctx.groups.ulysses.size) for t in (b, a))
    beta = b.sigmoid()
    g = -layer.A_log[heads].float().exp() * F.softplus(a.float() + layer.dt_bias[heads])
    return beta, g


def _segment_ids(ctx: CPContext, device) -> torch.Tensor:
    return ctx.segment_ids.to(device=device, dtype=torch.int32)[None]


def _conv_inputs(layer, q, k, v, share: _HeadShare):
    """q, k, v side by side as the conv's channels (B, C, T), and the matching rows of the conv weight and bias."""
    batch, seq = q.shape[:2]
    channels = _local_conv_channels(layer, share.key_heads, share.value_heads)
    weight = layer.conv1d.weight.squeeze(1)[channels]
    bias = None if layer.conv1d.bias is None else layer.conv1d.bias[channels]
    mixed = torch.cat([t.reshape(batch, seq, -1) for t in (q, k, v)], dim=-1).transpose(1, 2)
    return mixed, weight, bias


def _conv_outputs(layer, mixed: torch.Tensor, share: _HeadShare):
    """The conv's output channels (B, C, T) back to q, k (B, T, Hk, K) and v (B, T, Hv, V)."""
    batch, seq = mixed.shape[0], mixed.shape[2]
    key_width = len(share.key_heads) * layer.head_k_dim
    q, k, v = torch.split(mixed.transpose(1, 2), [key_width, key_width, len(share.value_heads) * layer.head_v_dim], -1)
    return (
        q.reshape(batch, seq, -1, layer.head_k_dim),
        k.reshape(batch, seq, -1, layer.head_k_dim),
        v.reshape(batch, seq, -1, layer.head_v_dim),
    )


@functools.cache
def _keeps_kernels_on_layer(layer_class: type) -> bool:
    """Whether the installed layer calls the conv and delta-rule functions it keeps on itself (see
    `FORWARD_KEEPS_KERNELS_ON_LAYER`) rather than its modeling module's."""
    return source_digest(layer_class.forward) in FORWARD_KEEPS_KERNELS_ON_LAYER


def torch_causal_conv(x: torch.Tensor, weight: torch.Tensor, bias=None, activation=None, **_) -> torch.Tensor:
    """What the layers that keep their kernels on themselves compute without causal-conv1d (`F.silu(self.conv1d(x)
    [..., :T])`: a depthwise conv padded by kernel - 1 on both sides, its first T outputs), for any rows of the conv
    weight (B, C, T) -> (B, C, T). Those releases apply SiLU whatever `activation` says, and so does this."""
    out = F.conv1d(x, weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1, groups=x.shape[1])
    return F.silu(out[..., : x.shape[-1]])


def _conv_function(modeling, layer):
    """The causal conv the installed layer runs, called as `conv(x, weight, bias, activation=...)`."""
    if _keeps_kernels_on_layer(type(layer)):
        return layer.causal_conv1d_fn or torch_causal_conv
    return modeling.causal_conv1d_fn


def _rule_function(modeling, layer):
    """The chunked gated delta rule the installed layer runs without a cache (the stock signature)."""
    if _keeps_kernels_on_layer(type(layer)):
        return layer.chunk_gated_delta_rule
    return modeling.torch_chunk_gated_delta_rule


def _causal_conv(modeling, layer, q, k, v, share: _HeadShare, ctx: CPContext):
    """The depthwise causal conv on this rank's channels over the whole row, reset at every sample."""
    mixed, weight, bias = _conv_inputs(layer, q, k, v, share)
    conv = _conv_function(modeling, layer)
    if _takes_packed_sequences(conv, mixed.device):
        mixed = conv(mixed, weight, bias, activation=layer.activation, seq_idx=_segment_ids(ctx, mixed.device))
    else:
        mixed = _per_sample(conv, ctx, 2, mixed, weight=weight, bias=bias, activation=layer.activation)
    return _conv_outputs(layer, mixed, share)


def _causal_conv_over_ring(modeling, layer, q, k, v, share: _HeadShare, ctx: CPContext):
    """The conv on this rank's channels over its subgroup's two chunks, each reading back through its halo."""
    mixed, weight, bias = _conv_inputs(layer, q, k, v, share)
    mixed = conv_over_ring(_conv_function(modeling, layer), mixed, ctx, weight=weight, bias=bias, activation=layer.activation)
    return _conv_outputs(layer, mixed, share)


@functools.cache
def _rule_expects_repeated_keys(layer_class: type) -> bool:
    """Whether the installed layer repeats q and k to the value heads before calling the delta rule (see
    `GATED_DELTANET_FORWARD`): then the rule functions of that release expect as many key as value heads."""
    return source_digest(layer_class.forward) in FORWARD_REPEATS_KEY_HEADS


def _keys_for_rule(layer, q, k, v):
    """q and k as the installed release's rule functions expect them (repeated to the value heads up to 5.22)."""
    if _rule_expects_repeated_keys(type(layer)) and v.shape[BSHD.heads] != q.shape[BSHD.heads]:
        groups = v.shape[BSHD.heads] // q.shape[BSHD.heads]
        q, k = q.repeat_interleave(groups, dim=BSHD.heads), k.repeat_interleave(groups, dim=BSHD.heads)
    return q, k


def _delta_rule_over_ring(modeling, layer, q, k, v, g, beta, ctx: CPContext) -> torch.Tensor:
    """The gated delta rule of this rank's heads over its subgroup's two chunks, each from its true initial state."""
    q, k = _keys_for_rule(layer, q, k, v)
    rule = _rule_function(modeling, layer)

    def piece(q, k, v, g, beta, initial_state):
        return rule(q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=True,
                    use_qk_l2norm_in_kernel=True)

    return delta_rule_over_ring(piece, q, k, v, g, beta, ctx)


def _delta_rule(modeling, layer, q, k, v, g, beta, ctx: CPContext) -> torch.Tensor:
    """The gated delta rule of this rank's heads over the whole row, reset at every packed sample."""
    q, k = _keys_for_rule(layer, q, k, v)
    rule = _rule_function(modeling, layer)
    options = dict(initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True)
    if _takes_packed_sequences(rule, q.device):
        return rule(q, k, v, g=g, beta=beta, cu_seqlens=ctx.cu_seqlens(q.device).long(), **options)[0]
    return _per_sample(lambda *t: rule(*t[:3], g=t[3], beta=t[4], **options), ctx, BSHD.seq, q, k, v, g, beta)


def gated_deltanet_over_cp(layer, hidden_states: torch.Tensor, ctx: CPContext) -> torch.Tensor:
    """One gated DeltaNet layer on this rank's slice (1, local, hidden) of the packed row, split by heads;
    equal to the stock layer run on each sample of the row alone (see the module docstring)."""
    modeling = sys.modules[type(layer).__module__]
    share = _HeadShare.of(layer, ctx)
    batch, local_len, _ = hidden_states.shape
    z = layer.in_proj_z(hidden_states).reshape(batch, local_len, -1, layer.head_v_dim)

    q, k, v = _heads_over_whole_sequence(layer, layer.in_proj_qkv(hidden_states), share, ctx)
    beta, g = _gates(layer, layer.in_proj_b(hidden_states), layer.in_proj_a(hidden_states), share, ctx)
    if ctx.contiguous:  # this rank's heads over the whole row
        q, k, v = _causal_conv(modeling, layer, q, k, v, share, ctx)
        out = _delta_rule(modeling, layer, q, k, v, g, beta, ctx)
    else:  # this rank's heads over its subgroup's two chunks, the state passed around the ring
        q, k, v = _causal_conv_over_ring(modeling, layer, q, k, v, share, ctx)
        out = _delta_rule_over_ring(modeling, layer, q, k, v, g, beta, ctx)
    ulysses = ctx.groups.ulysses
    out = all_to_all(out, BSHD.seq, BSHD.heads, ulysses.group, ulysses.size)  # (batch, local_len, num_v, head_v_dim)

    out = layer.norm(out.reshape(-1, layer.head_v_dim), z.reshape(-1, layer.head_v_dim))
    return layer.out_proj(out.reshape(batch, local_len, -1))


# The CP context of the decoder layer running now, where the decoder layer does not hand its keyword arguments on
# to its linear attention (`KWARGS_STOP_AT_DECODER_LAYER`): set by `context_for_linear_attention`.
_LAYER_CONTEXT: contextvars.ContextVar[CPContext | None] = contextvars.ContextVar("vlmcp_layer_ctx", default=None)


def context_for_linear_attention(wrapped, instance, args, kwargs):
    """A decoder layer's forward with the CP context it was given (`vlmcp_ctx`, from the text decoder) current while
    it runs, for its gated DeltaNet layer to read (`cp_gated_deltanet_forward`). Set on every call of the forward,
    so gradient checkpointing's recomputation of the layer, which calls it again with the same arguments, sees it
    too."""
    ctx = kwargs.get(CTX_KWARG)
    if ctx is None:
        return wrapped(*args, **kwargs)
    token = _LAYER_CONTEXT.set(ctx)
    try:
        return wrapped(*args, **kwargs)
    finally:
        _LAYER_CONTEXT.reset(token)


def cp_gated_deltanet_forward(wrapped, instance, args, kwargs):
    ctx = kwargs.pop(CTX_KWARG, None) or _LAYER_CONTEXT.get()
    if ctx is None:
        return wrapped(*args, **kwargs)
    call = call_arguments(wrapped, args, kwargs)
    with site(module_site(instance)):
        return run_ordered(gated_deltanet_over_cp, instance, call["hidden_states"], ctx)


# The MLPs that run in sequence tiles under CP (`tiles.py`), per family: Qwen3.5-MoE's gated MLP is its shared expert.
MLP_CLASSES = {
    "qwen3_5": MLPs(gated=("Qwen3_5MLP",), vision=("Qwen3_5VisionMLP",)),
    "qwen3_5_moe": MLPs(gated=("Qwen3_5MoeMLP",), vision=("Qwen3_5MoeVisionMLP",), experts=("Qwen3_5MoeExperts",)),
}


# The decoder's RMSNorms, recomputed in backward under CP (`tiles.recomputed_norm_forward`): layers, q / k, final. Not
# the DeltaNet layers' gated norm: its backward runs while the delta rule's saved intermediates are alive, the layer's
# peak, where its recompute's transient weighs more than what it saves (measured: +1 % at P = 2 in bf16).
NORM_CLASSES = {"qwen3_5": ("Qwen3_5RMSNorm",), "qwen3_5_moe": ("Qwen3_5MoeRMSNorm",)}


# The decoder layers and vision blocks whose checkpoints VLMCP_OFFLOAD_CHECKPOINTS keeps on the host (`offload.py`).
CHECKPOINTED_LAYERS = {
    "qwen3_5": ("Qwen3_5DecoderLayer", "Qwen3_5VisionBlock"),
    "qwen3_5_moe": ("Qwen3_5MoeDecoderLayer", "Qwen3_5MoeVisionBlock"),
}


def patches() -> list[Patch]:
    out = []
    for family in FAMILIES:
        out += family_patches(family, TEXT_MODEL_PARAMS, IMAGE_FEATURES)
        out += mlp_patches(family, MLP_CLASSES[family.name])
        out += norm_patches(family, NORM_CLASSES[family.name])
        out += offload_patches(family, CHECKPOINTED_LAYERS[family.name])
        prefix = family.text_model.removesuffix("TextModel")
        out.append(
            Patch(
                target=family.target(f"{prefix}GatedDeltaNet", "forward"),
                wrapper=cp_gated_deltanet_forward,
                reason="under CP: exchange sequence for heads so the causal conv and the delta-rule recurrence "
                "see the whole sequence (reset per packed sample) for this rank's heads",
                expects=("hidden_states", ("cache_params", "cache"), "attention_mask"),
                mirrors=GATED_DELTANET_FORWARD,
                family=family.name,
            )
        )
        out.append(
            Patch(
                target=family.target(f"{prefix}DecoderLayer", "forward"),
                wrapper=context_for_linear_attention,
                reason="under CP: the decoder layer of these releases calls its gated DeltaNet layer without its own "
                "keyword arguments; the CP context it was given is made current for the DeltaNet layer to read",
                expects=("hidden_states",),
                since=KWARGS_STOP_AT_DECODER_LAYER,
                family=family.name,
            )
        )
    return out
