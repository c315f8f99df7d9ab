"""The causal-LM loss of a sequence sharded over the CP group, computed without full-vocabulary logits.

The LM head and the cross-entropy run over this rank's slice in chunks of tokens: a chunk's logits
are computed, upcast to fp32, reduced to the loss sum and dropped; backward recomputes each chunk's
logits from the saved hidden states. At most one chunk of fp32 logits is alive at any time, instead
of the whole slice (~0.6 MB per token with Qwen's 151,936-word vocabulary). The arithmetic per token
is the stock one: logits in the head's dtype, upcast, log-softmax, and a gradient cast back to the
head's dtype before the two matmuls of the linear backward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .collectives import sum_keep_local_grad
from .context import CPContext

IGNORE_INDEX = -100


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """Labels moved one step left on the *full* sequence, as stock `ForCausalLMLoss` does."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def chunk_tokens(num_tokens: int, hidden_size: int, vocab_size: int, configured: int = 0) -> int:
    """Tokens per chunk: `configured` when set, else so that one chunk's fp32 logits take about as much
    memory as the slice's hidden states (Liger-Kernel's rule), at least 1."""
    if configured:
        return configured
    return max(1, math.ceil(num_tokens / max(1, math.ceil(vocab_size / hidden_size))))


def _chunks(n: int, size: int):
    return [(a, min(a + size, n)) for a in range(0, n, size)]


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Sum over tokens of cross_entropy(hidden @ weight.T (+ bias), labels), chunk by chunk.

    hidden (N, H) and weight (V, H) in the head's dtype; labels (N,) with IGNORE_INDEX for no target.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk):
        total = hidden.new_zeros((), dtype=torch.float32)
        for a, b in _chunks(hidden.shape[0], chunk):
            logits = F.linear(hidden[a:b], weight, bias).float()
            total = total + F.cross_entropy(logits, labels[a:b], ignore_index=IGNORE_INDEX, reduction="sum")
        ctx.save_for_backward(hidden, weight, bias, labels)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, bias, labels = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        grad_bias = None
        if bias is not None and ctx.needs_input_grad[2]:
            grad_bias = torch.zeros_like(bias, dtype=torch.float32)
        for a, b in _chunks(hidden.shape[0], ctx.chunk):
            h, y = hidden[a:b], labels[a:b]
            probs = F.linear(h, weight, bias).float().softmax(-1)
            valid = y != IGNORE_INDEX
            probs[valid.nonzero().flatten(), y[valid]] -= 1
            grad_logits = (probs * (grad_total * valid)[:, None]).to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[a:b] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight += (grad_logits.T @ h).float()
            if grad_bias is not None:
                grad_bias += grad_logits.float().sum(0)
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None,
            None,
        )


def _is_plain_linear(head) -> bool:
    """A head whose weight can be used directly: a bare nn.Linear with a local (not DTensor) weight."""
    return type(head) is torch.nn.Linear and type(head.weight) in (torch.Tensor, torch.nn.Parameter)


def head_loss_sum(hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """Sum of the token losses of `hidden` (N, H) under `head` against `labels` (N,), in fp32.

    A plain nn.Linear head is fused with the loss in chunks. Any other head (a PEFT-wrapped or FSDP-sharded
    one) is called once on the whole slice, as stock does, and only its fp32 upcast is chunked.
    """
    if _is_plain_linear(head):
        return _ChunkedLinearCrossEntropy.apply(hidden, head.weight, head.bias, labels, chunk)
    logits = head(hidden)
    return sum(
        F.cross_entropy(logits[a:b].float(), labels[a:b], ignore_index=IGNORE_INDEX, reduction="sum")
        for a, b in _chunks(logits.shape[0], chunk)
    )


def sharded_causal_lm_loss(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    ctx: CPContext,
    shift_labels: torch.Tensor,
    num_items_in_batch: torch.Tensor | int | None = None,
    configured_chunk: int = 0,
) -> torch.Tensor:
    """Per-token mean over the whole sequence; the same value on every rank of the group.

    `hidden` is this rank's slice (1, local, H) of the decoder output; `shift_labels` the labels of the
    whole packed row (1, seq) already shifted, so the target of a slice's last token comes from the next
    rank's slice. Valid tokens are counted over the row (or `num_items_in_batch` is used when the caller
    normalises across gradient-accumulation steps, like stock).
    """
    local_labels = ctx.shard(shift_labels.to(hidden.device), dim=1, value=IGNORE_INDEX).reshape(-1)
    flat = hidden.reshape(-1, hidden.shape[-1])
    vocab = getattr(head, "out_features", None) or flat.shape[-1]
    chunk = chunk_tokens(flat.shape[0], flat.shape[-1], vocab, configured_chunk)
    total = sum_keep_local_grad(head_loss_sum(flat, head, local_labels, chunk), ctx.cp.group, ctx.cp.size)
    count = (shift_labels != IGNORE_INDEX).sum() if num_items_in_batch is None else num_items_in_batch
    if torch.is_tensor(count):
        count = count.to(total.device)
    return total / count
