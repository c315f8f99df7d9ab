"""The gated DeltaNet layer's state passing across a CP ring, one chunk at a time (`models/deltanet_ring.py`): a row
of packed samples cut into 1 to 8 chunks of uneven lengths, each chunk's conv read through its halo and its delta
rule run from the state the earlier chunks' transfers compose to, equals the conv and the sequential recurrence
over each sample alone — outputs and gradients. A composition that drops the transfers' linear part fails."""

from __future__ import annotations

import pytest
import torch

from vlmcp_patch.fixtures.compare import rel_err
from vlmcp_patch.layout import segments_from_lengths
from vlmcp_patch.models import deltanet_ring
from vlmcp_patch.models.deltanet_ring import compose, conv_of_chunk, pieces_of, rule_of_chunk, transfer_of_chunk
from vlmcp_patch.models.qwen3_5 import torch_causal_conv

SAMPLES = [11, 3, 17, 6]  # a sample boundary inside most chunks, a short sample inside one chunk
HEADS, KEYS, VALUES, KERNEL = 2, 4, 5, 4


def modeling():
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return modeling_qwen3_5


def causal_conv(x, weight, bias=None, activation=None):
    """The causal conv the installed release's layer runs without causal-conv1d: the modeling module's (5.15 on),
    or the layer's nn.Conv1d and SiLU, which `qwen3_5.torch_causal_conv` computes from the weight (up to 5.14)."""
    return (modeling().causal_conv1d_fn or torch_causal_conv)(x, weight, bias, activation=activation)


def rule(q, k, v, g, beta, initial_state):
    return modeling().torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=initial_state,
                                                   output_final_state=True, use_qk_l2norm_in_kernel=True)


def sequential(q, k, v, g, beta):
    """The token-by-token recurrence over each sample alone (transformers' reference implementation)."""
    segments = segments_from_lengths(SAMPLES)
    return torch.cat([modeling().torch_recurrent_gated_delta_rule(
        *(t[:, a:b] for t in (q, k, v)), g=g[:, a:b], beta=beta[:, a:b], initial_state=None,
        output_final_state=False, use_qk_l2norm_in_kernel=True)[0] for a, b in segments], dim=1)


def inputs():
    g = torch.Generator().manual_seed(0)
    n = sum(SAMPLES)
    q, k = (torch.randn(1, n, HEADS, KEYS, generator=g) for _ in range(2))
    v = torch.randn(1, n, HEADS, VALUES, generator=g)
    gate = -torch.rand(1, n, HEADS, generator=g)
    beta = torch.rand(1, n, HEADS, generator=g)
    x = torch.randn(1, 3, n, generator=g)
    weight = torch.randn(3, KERNEL, generator=g)
    return [t.requires_grad_(True) for t in (q, k, v, gate, beta, x, weight)]


def cuts(count: int) -> list[int]:
    """Uneven chunk boundaries (count chunks over the row)."""
    n = sum(SAMPLES)
    bounds = sorted({0, n, *torch.randperm(n - 1, generator=torch.Generator().manual_seed(count))[: count - 1].add(1)
                     .tolist()})
    return bounds


def chunked(tensors, count: int, compose_fn=compose):
    q, k, v, gate, beta, x, weight = tensors
    segments = segments_from_lengths(SAMPLES)
    bounds = cuts(count)
    conv = lambda t, weight: causal_conv(t, weight, None, activation="silu")  # noqa: E731
    conv_out, rule_out, transfers = [], [], []
    for first, last in zip(bounds[:-1], bounds[1:]):
        pieces = pieces_of(segments, first, last)
        halo = x[..., max(0, first - (KERNEL - 1)):first] if first else None
        conv_out.append(conv_of_chunk(conv, x[..., first:last], pieces, halo, weight=weight))
        tensors = [t[:, first:last] for t in (q, k, v, gate, beta)]
        rule_out.append(rule_of_chunk(rule, *tensors, pieces, compose_fn(transfers, KEYS)))
        transfers.append(transfer_of_chunk(rule, *tensors, pieces))
    return torch.cat(conv_out, dim=2), torch.cat(rule_out, dim=1)


def reference(tensors):
    q, k, v, gate, beta, x, weight = tensors
    segments = segments_from_lengths(SAMPLES)
    conv = torch.cat([causal_conv(x[..., a:b], weight, None, activation="silu") for a, b in segments], dim=2)
    return conv, sequential(q, k, v, gate, beta)


def _errors(count: int, compose_fn=compose) -> tuple[float, float, float, float]:
    tensors = inputs()
    conv, out = chunked(tensors, count, compose_fn)
    (conv.sum() + (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()).backward()
    grads = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    ref_conv, ref_out = reference(tensors)
    (ref_conv.sum() + (ref_out * torch.linspace(-1, 1, ref_out.numel()).view_as(ref_out)).sum()).backward()
    return (rel_err(conv, ref_conv), rel_err(out, ref_out),
            max(rel_err(a, t.grad) for a, t in zip(grads, tensors)), len(cuts(count)) - 1)


@pytest.mark.parametrize("count", range(1, 9))
def test_chunks_equal_the_sequential_recurrence_per_sample(count):
    conv_err, out_err, grad_err, chunks = _errors(count)
    assert chunks == count
    assert conv_err <= 1e-6 and out_err <= 1e-5 and grad_err <= 1e-5, (conv_err, out_err, grad_err)


def test_a_composition_without_the_linear_part_is_caught():
    def finals_only(transfers, keys):  # each chunk would restart from the last chunk's own final state
        return None if not transfers else transfers[-1][..., keys:]

    _, out_err, _, _ = _errors(5, compose_fn=finals_only)
    assert out_err > 1e-2


def test_pieces_mark_the_samples_continuing_from_before_the_chunk():
    assert pieces_of([(0, 5), (5, 9), (9, 20)], 4, 12) == [
        deltanet_ring.Piece(0, 1, 4), deltanet_ring.Piece(1, 5, 0), deltanet_ring.Piece(5, 8, 0)]
