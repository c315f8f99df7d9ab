"""A pure-torch stand-in for the flash-attn package, registered where transformers looks for it.

flash-attn needs CUDA; this lets the real `flash_attention_2` code path of transformers (and the
package's wrapper around it) run on CPU. The kernels compute exact softmax attention per sequence
(with sdpa, or explicitly where the log-sum-exp is asked for; the ring's backward through the internal
`_flash_attn_varlen_backward`) and record the sequence boundaries they were given, so tests can check the plumbing.
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


def _sequences(cu_seqlens_q, cu_seqlens_k):
    q_edges, k_edges = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return list(zip(zip(q_edges, q_edges[1:]), zip(k_edges, k_edges[1:])))


def _probabilities(q, k, causal, scale, lse=None):
    """Softmax probabilities (H, Tq, Tk) of one sequence, from the given log-sum-exp (H, Tq) when there is one, and
    the log-sum-exp. Causal with Tq == Tk only (what the package asks for)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if causal:
        assert q.shape[0] == k.shape[0]
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1) if lse is None else lse
    return torch.exp(scores - lse[..., None]), lse


def _attend_with_lse(q, k, v, causal, scale):
    probs, lse = _probabilities(q, k, causal, scale)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1).float()
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype), lse


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0,
    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
    deterministic=False, return_attn_probs=False, block_table=None,
):
    """flash-attn's varlen kernel; with return_attn_probs=True: (out, softmax_lse (H, total_q), None)."""
    sequences = _sequences(cu_seqlens_q, cu_seqlens_k)
    CALLS.append({"kind": "varlen", "causal": causal, "edges": cu_seqlens_q.tolist(),
                  "key_edges": cu_seqlens_k.tolist(), "lse": return_attn_probs})
    if return_attn_probs:
        results = [_attend_with_lse(q[a:b], k[c:d], v[c:d], causal, softmax_scale) for (a, b), (c, d) in sequences]
        return torch.cat([o for o, _ in results]), torch.cat([lse for _, lse in results], dim=1), None
    assert torch.equal(cu_seqlens_q, cu_seqlens_k)
    pieces = [_attend(q[a:b], k[a:b], v[a:b], causal, softmax_scale) for (a, b), _ in sequences]
    return torch.cat(pieces, dim=0)


def _flash_attn_varlen_backward(
    dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
    softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None,
    zero_tensors=False,
):
    """flash-attn 2.7's internal varlen backward: gradients from the given out and log-sum-exp, into dq, dk, dv."""
    assert dropout_p == 0 and (window_size_left, window_size_right) == (-1, -1) and softcap == 0
    CALLS.append({"kind": "varlen_bwd", "causal": causal, "edges": cu_seqlens_q.tolist(),
                  "key_edges": cu_seqlens_k.tolist()})
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    group = q.shape[1] // k.shape[1]
    for (a, b), (c, d) in _sequences(cu_seqlens_q, cu_seqlens_k):
        probs, _ = _probabilities(q[a:b], k[c:d], causal, scale, softmax_lse[:, a:b].float())
        do, o = dout[a:b].float(), out[a:b].float()
        ks, vs = (t[c:d].repeat_interleave(group, dim=1).float() for t in (k, v))
        dv_seq = torch.einsum("hqk,qhd->khd", probs, do)
        dscores = probs * (torch.einsum("qhd,khd->hqk", do, vs) - (do * o).sum(-1).T[..., None]) * scale
        dq[a:b] = torch.einsum("hqk,khd->qhd", dscores, ks).to(dq.dtype)
        dk_seq = torch.einsum("hqk,qhd->khd", dscores, q[a:b].float())
        dk[c:d] = dk_seq.unflatten(1, (k.shape[1], group)).sum(2).to(dk.dtype)
        dv[c:d] = dv_seq.unflatten(1, (v.shape[1], group)).sum(2).to(dv.dtype)
    return dq, dk, dv, None


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
    interface._flash_attn_varlen_backward = _flash_attn_varlen_backward
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


def stock_flash_attention_works() -> bool:
    """False on transformers 5.6.0, whose flash_attention_forward calls `s_aux.to(...)` with no attention sink
    (None) for every model, stock included (fixed in 5.6.1): there is no flash_attention_2 path to compare with."""
    import transformers

    return transformers.__version__ != "5.6.0"
