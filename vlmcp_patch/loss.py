"""The LM head's outputs of a sequence sharded over the CP group, computed in chunks of tokens without
full-vocabulary logits: the causal-LM loss, and per-token log-probabilities and entropies (RL).

**The loss** (`_FusedLinearCrossEntropy`, Liger-Kernel's fused linear cross-entropy): the loss is a scalar,
so its gradient is known up to one factor during the forward pass. Each chunk's logits are computed once
(upcast to fp32, as stock does), reduced to the loss, turned in place into the gradient of the logits
(softmax minus one-hot), cast back to the head's dtype and multiplied into the gradients of the hidden
states and of the weight — three matmuls per chunk, no recompute; backward only scales them by the
incoming gradient. At most one chunk of fp32 logits is alive at any time. Backward scales the stored gradients in
place and hands them on (the weight's fp32 buffer becomes its `.grad`): nothing is copied and the graph holds
nothing after it. Under `retain_graph` it hands on scaled copies and keeps the stored gradients until the graph is
freed, so every later backward accumulates the same gradients again, as stock's does from its saved tensors. A
second-order gradient (`create_graph=True`) is refused: the gradients were computed without a graph.

**Chunk size** (`chunk_tokens`): a chunk's fp32 logits take `LOGITS_PER_HIDDEN` times the memory of the
slice's hidden states, so the head's working memory shrinks with the slice (as 1/P), like everything else per
rank. The factor is a trade measured with `benchmarks.head` (the head alone) and `benchmarks.speed`: each chunk
reads the head's weight twice and reads and writes its fp32 gradient once however few rows it has, so many
small chunks leave the matmuls memory-bound, and that cost stays on every rank whatever P is. At 32 a slice is
cut into about vocabulary / (32 x hidden) chunks — two for Qwen3-VL-2B, three for Qwen3.5, each under half of
stock's fp32 logits (which stock holds with their softmax and gradient) — and the fused head costs what stock's
does. A chunk holds at least `MIN_CHUNK` tokens (or the whole slice) and its fp32 logits at most
`MAX_CHUNK_BYTES`, which bounds the head on long slices. `VLMCP_LOSS_CHUNK` sets it by hand.

**Log-probabilities and entropies** (`_ChunkedTokenLogProbs`): per token, log p(target) and the entropy of
softmax(logits / temperature). Their gradient depends on how the caller uses them, so backward recomputes
each chunk's logits (four matmuls per chunk).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .collectives.differentiable import sum_keep_local_grad
from .context import CPContext

IGNORE_INDEX = -100
LOGITS_PER_HIDDEN = 32  # a chunk's fp32 logits ~ 32x the slice's hidden states (module docstring)
# tokens; a larger floor would hold the head's memory constant where slices are short, instead of 1/P
MIN_CHUNK = 32
MAX_CHUNK_BYTES = 1 << 30  # fp32 logits of one chunk, at most


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """Labels moved one step left on the *full* sequence, as stock `ForCausalLMLoss` does."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def chunk_tokens(num_tokens: int, hidden_size: int, vocab_size: int, configured: int = 0) -> int:
    """Tokens per chunk of the head (module docstring): `configured` when set; else the slice cut in equal chunks
    of at least `LOGITS_PER_HIDDEN` x the slice's hidden states of fp32 logits each (a runt would read the whole
    weight for a few rows) and at least `MIN_CHUNK` tokens (or the whole slice), unless that exceeds
    `MAX_CHUNK_BYTES`: then equal chunks within it."""
    if configured:
        return configured
    proportional = math.ceil(num_tokens * hidden_size * LOGITS_PER_HIDDEN / vocab_size)
    size = max(1, proportional, min(num_tokens, MIN_CHUNK))
    chunk = math.ceil(num_tokens / max(1, num_tokens // size))
    largest = max(1, MAX_CHUNK_BYTES // (4 * vocab_size))
    return chunk if chunk <= largest else math.ceil(num_tokens / math.ceil(num_tokens / largest))


def _chunks(n: int, size: int):
    return [(a, min(a + size, n)) for a in range(0, n, size)]


def _logits_grad_in_place(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The gradient of the summed cross-entropy w.r.t. fp32 `logits` (c, V), written over them: softmax minus
    one-hot, zero rows where the label is ignored. Returns the chunk's loss sum. Five passes over the chunk."""
    valid = labels != IGNORE_INDEX
    rows = valid.nonzero().flatten()
    picked = logits[rows, labels[rows]]  # the targets' logits, before they are overwritten
    peak = logits.amax(-1, keepdim=True)
    torch.exp(logits.sub_(peak), out=logits)
    total = logits.sum(-1, keepdim=True)
    loss = (total[rows, 0].log() + peak[rows, 0] - picked).sum()
    logits.div_(total)
    logits[rows, labels[rows]] -= 1
    logits[~valid] = 0
    return loss


def _accumulate_head_grads(grad_logits, h, weight, grad_hidden, grad_weight, grad_bias, a: int, b: int) -> None:
    """Chunk [a, b)'s share of the head's gradients from its logits' gradient (c, V) in the head's dtype: rows a:b
    of `grad_hidden` (N, H), and added into the fp32 `grad_weight` (V, H) / `grad_bias` (V,); None: not wanted."""
    if grad_hidden is not None:
        torch.matmul(grad_logits, weight, out=grad_hidden[a:b])
    if grad_weight is not None:
        grad_weight.addmm_(grad_logits.T.float(), h.float())
    if grad_bias is not None:
        grad_bias += grad_logits.float().sum(0)


_SECOND_BACKWARD = ("Trying to backward through vlmcp_patch's fused LM head a second time: its stored gradients "
                    "were freed at the first backward. Specify retain_graph=True if you need to backward through "
                    "the graph a second time.")


def _refuse_second_order(what: str) -> None:
    """Raises in a backward run with `create_graph=True` (grad mode on): stock's head is differentiable twice, the
    chunked head's gradients are computed without a graph (they would come back as constants)."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"vlmcp_patch's chunked LM head ({what}) cannot be differentiated twice (create_graph=True): it computes "
            "its gradients without a graph. Take second-order gradients through the logits instead (a forward "
            "without labels returns them).")


def _graph_is_kept() -> bool:
    """Whether the running backward keeps the graph (`retain_graph`, or `create_graph`); True outside one."""
    return torch._C._autograd._get_current_graph_task_keep_graph()


def _scaled(grad: torch.Tensor, dtype, scale, in_place: bool) -> torch.Tensor:
    """`grad` cast to `dtype` (None: as it is) and times `scale` (None: 1); written over `grad` when `in_place`
    (the weight's fp32 buffer then becomes its .grad, no copy), else a new tensor and `grad` left as it was."""
    if dtype is not None and grad.dtype != dtype:
        grad = grad.to(dtype)  # a new tensor already
        in_place = True
    if scale is None:
        return grad if in_place else grad.clone()
    return grad.mul_(scale.to(grad.dtype)) if in_place else grad * scale.to(grad.dtype)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Sum over tokens of cross_entropy(hidden @ weight.T (+ bias), labels), with its gradient computed during
    the forward pass, chunk by chunk (module docstring).

    hidden (N, H) and weight (V, H) in the head's dtype; labels (N,) with IGNORE_INDEX for no target.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk, grad_enabled):
        # needs_input_grad follows requires_grad even under no_grad (evaluation), and the forward itself always
        # runs without grad mode: the caller's mode comes as `grad_enabled`
        want = ctx.needs_input_grad if grad_enabled else (False, False, False)
        grad_hidden = torch.empty_like(hidden) if want[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None and want[2] else None
        total = hidden.new_zeros((), dtype=torch.float32)
        # stock's cross-entropy gives an ignored target a zero gradient whatever the loss's gradient is: with no
        # target in the batch that gradient is 1/0 (a NaN loss) and the parameters' gradients are still zeros
        ctx.has_targets = bool((labels != IGNORE_INDEX).any())
        for a, b in _chunks(hidden.shape[0], chunk):
            h = hidden[a:b]
            logits = F.linear(h, weight, bias).float()
            if any(want[:3]):
                total += _logits_grad_in_place(logits, labels[a:b])
                _accumulate_head_grads(logits.to(hidden.dtype), h, weight, grad_hidden, grad_weight, grad_bias, a, b)
            else:
                total += F.cross_entropy(logits, labels[a:b], ignore_index=IGNORE_INDEX, reduction="sum")
            del logits  # freed before the next chunk's are made: one chunk of logits alive at a time
        ctx.grads = (grad_hidden, grad_weight, grad_bias, weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        _refuse_second_order("loss")
        if ctx.grads is None:
            raise RuntimeError(_SECOND_BACKWARD)
        grad_hidden, grad_weight, grad_bias, weight_dtype, bias_dtype = ctx.grads
        kept = _graph_is_kept()
        if not kept:
            ctx.grads = None  # freed at this backward, as stock frees its saved tensors
        # no target here: the gradients are exact zeros, as stock's, even for a non-finite `grad_total`
        scale = None if not ctx.has_targets or bool(grad_total == 1) else grad_total
        out = [None if grad is None else _scaled(grad, dtype, scale, in_place=not kept)
               for grad, dtype in ((grad_hidden, None), (grad_weight, weight_dtype), (grad_bias, bias_dtype))]
        return (*out, None, None, None)


def _is_plain_linear(head) -> bool:
    """A head whose weight can be used directly: a bare nn.Linear with a local (not DTensor) weight."""
    return type(head) is torch.nn.Linear and type(head.weight) in (torch.Tensor, torch.nn.Parameter)


def head_loss_sum(hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """Sum of the token losses of `hidden` (N, H) under `head` against `labels` (N,), in fp32.

    A plain nn.Linear head is fused with the loss in chunks. Any other head (a PEFT-wrapped or FSDP-sharded
    one) is called once on the whole slice, as stock does, and only its fp32 upcast is chunked.
    """
    if _is_plain_linear(head):
        return _FusedLinearCrossEntropy.apply(hidden, head.weight, head.bias, labels, chunk, torch.is_grad_enabled())
    logits = head(hidden)
    if not logits.shape[0]:  # no rows on this rank (kept logits elsewhere): a zero that still reaches the backbone
        return logits.float().sum()
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
    return _mean_over_group(flat, head, ctx, local_labels, shift_labels, num_items_in_batch, configured_chunk)


def kept_causal_lm_loss(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    ctx: CPContext,
    rows: torch.Tensor,
    local_targets: torch.Tensor,
    targets: torch.Tensor,
    num_items_in_batch: torch.Tensor | int | None = None,
    configured_chunk: int = 0,
) -> torch.Tensor:
    """Stock's loss over the logits a forward keeps (`logits_to_keep`, `forward/keep.py`); the same value on every rank.

    `hidden` is this rank's slice (1, local, H); `rows` (n,) the rows of it that hold kept logits (a row may repeat),
    `local_targets` (n,) their targets; `targets` every kept logit's target over the group, which the valid targets
    are counted from (or `num_items_in_batch` is used, like stock)."""
    flat = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows.to(hidden.device))
    return _mean_over_group(flat, head, ctx, local_targets.to(hidden.device), targets, num_items_in_batch,
                            configured_chunk)


def _mean_over_group(flat, head, ctx, local_labels, all_labels, num_items_in_batch, configured_chunk) -> torch.Tensor:
    """The token losses of this rank's rows `flat` (n, H) against `local_labels` (n,), summed over the group, over the
    valid labels of `all_labels` (every rank's) or `num_items_in_batch`."""
    vocab = getattr(head, "out_features", None) or flat.shape[-1]
    chunk = max(1, chunk_tokens(flat.shape[0], flat.shape[-1], vocab, configured_chunk))  # 1: no rows here
    total = sum_keep_local_grad(head_loss_sum(flat, head, local_labels, chunk), ctx.cp.group, ctx.cp.size)
    count = (all_labels != IGNORE_INDEX).sum() if num_items_in_batch is None else num_items_in_batch
    if torch.is_tensor(count):
        count = count.to(total.device)
    return total / count


# ---------------------------------------------------------------------------------------------------------
# Per-token log-probabilities and entropies


def _log_softmax_in_place(z: torch.Tensor) -> torch.Tensor:
    return z.sub_(torch.logsumexp(z, -1, keepdim=True))


def _scaled_logits(h, weight, bias, temperature: float) -> torch.Tensor:
    logits = F.linear(h, weight, bias).float()
    return logits if temperature == 1.0 else logits.div_(temperature)


class _ChunkedTokenLogProbs(torch.autograd.Function):
    """Per token: log softmax(z)[target] and the entropy of softmax(z), z = (hidden @ weight.T (+ bias)) / T in
    fp32; both 0 where the target is IGNORE_INDEX. hidden (N, H), weight (V, H), targets (N,): (N,) fp32 each."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk):
        log_probs = hidden.new_zeros(hidden.shape[0], dtype=torch.float32)
        entropy = torch.zeros_like(log_probs)
        for a, b in _chunks(hidden.shape[0], chunk):
            logp = _log_softmax_in_place(_scaled_logits(hidden[a:b], weight, bias, temperature))
            valid = targets[a:b] != IGNORE_INDEX
            picked = logp.gather(-1, targets[a:b].clamp(min=0)[:, None])[:, 0]
            log_probs[a:b] = torch.where(valid, picked, 0.0)
            entropy[a:b] = torch.where(valid, -logp.exp().mul_(logp).sum(-1), 0.0)
            del logp  # before the next chunk's logits
        ctx.save_for_backward(hidden, weight, bias, targets, entropy)
        ctx.temperature, ctx.chunk = temperature, chunk
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        _refuse_second_order("log-probabilities")
        hidden, weight, bias, targets, entropy = ctx.saved_tensors
        want = ctx.needs_input_grad
        grad_hidden = torch.empty_like(hidden) if want[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None and want[2] else None
        for a, b in _chunks(hidden.shape[0], ctx.chunk):
            h, y = hidden[a:b], targets[a:b]
            logp = _log_softmax_in_place(_scaled_logits(h, weight, bias, ctx.temperature))
            # zero where the target is ignored, as stock's `torch.where` gives, whatever the incoming gradient there
            valid = y != IGNORE_INDEX
            g_logp = torch.where(valid, grad_log_probs[a:b], 0.0)[:, None]
            g_ent = torch.where(valid, grad_entropy[a:b], 0.0)[:, None]
            # d logp_y / dz = onehot - p;  d H / dz = -p (log p + H): written over logp, two (c, V) buffers at most
            p = logp.exp()
            grad_z = logp.add_(entropy[a:b, None]).mul_(g_ent).add_(g_logp).mul_(p).neg_()
            del p
            grad_z.scatter_add_(-1, y.clamp(min=0)[:, None], g_logp)
            grad_logits = (grad_z if ctx.temperature == 1.0 else grad_z.div_(ctx.temperature)).to(hidden.dtype)
            _accumulate_head_grads(grad_logits, h, weight, grad_hidden, grad_weight, grad_bias, a, b)
            del logp, grad_z, grad_logits  # before the next chunk's logits
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None)


def token_log_probs_and_entropy(hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor,
                                temperature: float = 1.0, chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), entropy) per token of `hidden` (N, H) under `head` at `temperature`, each (N,) fp32, 0 where
    `targets` (N,) is IGNORE_INDEX; in chunks, never the (N, vocabulary) logits. A head that is not a bare
    nn.Linear is called once on the whole slice."""
    if _is_plain_linear(head):
        size = chunk or chunk_tokens(hidden.shape[0], hidden.shape[-1], head.out_features)
        return _ChunkedTokenLogProbs.apply(hidden, head.weight, head.bias, targets, float(temperature), size)
    return log_probs_and_entropy_of_logits(head(hidden), targets, temperature)


def log_probs_and_entropy_of_logits(logits: torch.Tensor, targets: torch.Tensor,
                                    temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The same from whole logits (..., V) and targets (...): (...) fp32 each, 0 where the target is IGNORE_INDEX."""
    logp = (logits.float() / temperature).log_softmax(-1)
    valid = targets != IGNORE_INDEX
    picked = torch.where(valid, logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0], 0.0)
    return picked, torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)
