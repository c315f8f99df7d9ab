"""The chunked LM head + cross-entropy equals the plain one (logits of the whole slice, fp32 upcast,
cross_entropy): the loss and every gradient, in fp32 and through a head that is not a bare nn.Linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vlmcp_patch.fixtures.compare import rel_err
from vlmcp_patch.loss import IGNORE_INDEX, chunk_tokens, head_loss_sum


def _plain(hidden, head, labels):
    return F.cross_entropy(head(hidden).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def _case(n=37, h=24, v=101, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(h, v, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, h, generator=g) * 0.3)
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::5] = IGNORE_INDEX
    return hidden, head, labels


def _loss_and_grads(fn, hidden, head, labels):
    hidden = hidden.detach().clone().requires_grad_(True)
    head.zero_grad(set_to_none=True)
    loss = fn(hidden, head, labels)
    (loss * 0.37).backward()
    return loss.detach(), hidden.grad, head.weight.grad


@pytest.mark.parametrize("chunk", [1, 4, 16, 37, 64])
def test_chunked_loss_equals_the_plain_loss(chunk):
    hidden, head, labels = _case()
    ours = _loss_and_grads(lambda x, m, y: head_loss_sum(x, m, y, chunk), hidden, head, labels)
    plain = _loss_and_grads(_plain, hidden, head, labels)
    for a, b in zip(ours, plain):
        assert rel_err(a, b) <= 1e-6


def test_a_wrapped_head_is_called_once_and_gives_the_same_loss():
    """A head that is not a bare nn.Linear (PEFT, FSDP2-sharded) is called as a module, once."""
    hidden, head, labels = _case(seed=1)
    calls = []

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = head
            self.out_features = head.out_features

        def forward(self, x):
            calls.append(x.shape[0])
            return self.inner(x)

    ours = _loss_and_grads(lambda x, m, y: head_loss_sum(x, Wrapped(), y, 8), hidden, head, labels)
    plain = _loss_and_grads(_plain, hidden, head, labels)
    assert calls == [37]
    for a, b in zip(ours, plain):
        assert rel_err(a, b) <= 1e-6


def test_no_chunk_of_fp32_logits_is_kept_for_backward():
    """Only the hidden slice, the weight and the labels are saved: no logits of any size."""
    hidden, head, labels = _case(n=64, h=16, v=257)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        head_loss_sum(hidden, head, labels, chunk=8)
    assert all(257 not in shape or shape == tuple(head.weight.shape) for shape in saved), saved


def test_chunk_size_follows_the_slice():
    assert chunk_tokens(16384, 2048, 151936) == 219  # one chunk's fp32 logits ~ the slice's hidden states
    assert chunk_tokens(8192, 2048, 151936) == 110
    assert chunk_tokens(10, 2048, 151936, configured=512) == 512
