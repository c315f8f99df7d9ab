"""A pure-torch stand-in for the flash-attn package, registered where transformers looks for it.

flash-attn needs CUDA; this lets the real `flash_attention_2` code path of transformers (and the
package's wrapper around it) run on CPU. The kernels compute exact softmax attention per sequence
with sdpa and record the sequence boundaries they were given, so tests can check the plumbing.
"""

from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F

CALLS: list[dict] = []  # one entry per kernel call: kind, causal, batch, sequence edges


def _attend(q, k, v, causal, scale):
    # q: (S, H, D); k, v: (S, Hkv, D)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=causal, scale=scale
    )
    return out.transpose(0, 1)


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0,
    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
    deterministic=False, return_attn_probs=False, block_table=None,
):
    assert torch.equal(cu_seqlens_q, cu_seqlens_k)
    edges = cu_seqlens_q.tolist()
    CALLS.append({"kind": "varlen", "causal": causal, "edges": edges})
    pieces = [_attend(q[a:b], k[a:b], v[a:b], causal, softmax_scale) for a, b in zip(edges[:-1], edges[1:])]
    return torch.cat(pieces, dim=0)


def flash_attn_func(
    q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, deterministic=False, return_attn_probs=False,
):
    CALLS.append({"kind": "dense", "causal": causal, "batch": q.shape[0], "edges": [0, q.shape[1]]})
    return torch.stack([_attend(q[b], k[b], v[b], causal, softmax_scale) for b in range(q.shape[0])])


def install() -> None:
    """Make transformers load this module as flash-attn 2."""
    import importlib.machinery

    import transformers.modeling_flash_attention_utils as fa_utils

    flash_attn = types.ModuleType("flash_attn")
    flash_attn.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    flash_attn.flash_attn_func = flash_attn_func
    flash_attn.flash_attn_varlen_func = flash_attn_varlen_func
    flash_attn.flash_attn_with_kvcache = None
    interface = types.ModuleType("flash_attn.flash_attn_interface")  # where flash-attn defines them
    interface.flash_attn_func, interface.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    flash_attn.flash_attn_interface = interface
    sys.modules["flash_attn.flash_attn_interface"] = interface
    padding = types.ModuleType("flash_attn.bert_padding")
    padding.pad_input, padding.unpad_input = fa_utils._pad_input, fa_utils._unpad_input
    flash_attn.bert_padding = padding
    sys.modules["flash_attn"], sys.modules["flash_attn.bert_padding"] = flash_attn, padding
    fa_utils.is_flash_attn_2_available = lambda *a, **k: True
    fa_utils.is_flash_attn_3_available = lambda *a, **k: False
    fa_utils.is_flash_attn_4_available = lambda *a, **k: False
    fa_utils._loaded_implementation = None


def use_flash(model) -> None:
    """Switch a model built with sdpa to flash_attention_2 (creation-time checks would demand CUDA)."""
    for config in (model.config, model.config.get_text_config(), getattr(model.config, "vision_config", None)):
        if config is not None:
            config._attn_implementation = "flash_attention_2"
