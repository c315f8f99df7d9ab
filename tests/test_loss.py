"""The chunked LM head equals the plain one (logits of the whole slice, fp32 upcast): the fused loss with its
gradient computed in the forward pass, and the per-token log-probabilities / entropies — values and every
gradient, over chunk sizes, with a bias, ignored labels, a temperature, in bf16, through a wrapped head."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from vlmcp_patch.fixtures.compare import rel_err
from vlmcp_patch.loss import IGNORE_INDEX, MIN_CHUNK, chunk_tokens, head_loss_sum, token_log_probs_and_entropy


def _plain(hidden, head, labels):
    return F.cross_entropy(head(hidden).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def _case(n=37, h=24, v=101, seed=0, bias=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(h, v, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, h, generator=g) * 0.3)
        if bias:
            head.bias.copy_(torch.randn(v, generator=g))
    hidden = torch.randn(n, h, generator=g)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::5] = IGNORE_INDEX
    return hidden.to(dtype), head.to(dtype), labels


def _loss_and_grads(fn, hidden, head, labels, scale=0.37):
    hidden = hidden.detach().clone().requires_grad_(True)
    head.zero_grad(set_to_none=True)
    loss = fn(hidden, head, labels)
    (loss * scale).backward()
    grads = [hidden.grad, head.weight.grad] + ([head.bias.grad] if head.bias is not None else [])
    return [loss.detach(), *grads]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [1, 4, 7, 37, 64])
def test_fused_loss_equals_the_plain_loss(chunk, bias):
    hidden, head, labels = _case(bias=bias)
    ours = _loss_and_grads(lambda x, m, y: head_loss_sum(x, m, y, chunk), hidden, head, labels)
    plain = _loss_and_grads(_plain, hidden, head, labels)
    for a, b in zip(ours, plain):
        assert rel_err(a, b) <= 1e-6


def test_fused_loss_in_bf16_matches_the_plain_bf16_loss():
    hidden, head, labels = _case(dtype=torch.bfloat16)
    ours = _loss_and_grads(lambda x, m, y: head_loss_sum(x, m, y, 8), hidden, head, labels)
    plain = _loss_and_grads(_plain, hidden, head, labels)
    assert all(t.dtype == torch.bfloat16 for t in ours[1:])
    for a, b in zip(ours, plain):  # bf16 rounding of the gradients, the loss in fp32
        assert rel_err(a, b) <= 2e-2


def test_fused_loss_without_gradients_and_with_an_unscaled_backward():
    hidden, head, labels = _case(seed=3)
    with torch.no_grad():
        assert rel_err(head_loss_sum(hidden, head, labels, 5), _plain(hidden, head, labels)) <= 1e-6
    ours = _loss_and_grads(lambda x, m, y: head_loss_sum(x, m, y, 5), hidden, head, labels, scale=1.0)
    plain = _loss_and_grads(_plain, hidden, head, labels, scale=1.0)
    for a, b in zip(ours, plain):
        assert rel_err(a, b) <= 1e-6


def test_no_gradient_buffers_under_no_grad_though_the_weights_require_grad():
    """Evaluation with labels (the Trainer's prediction step): the head's weight requires grad, but no grad mode, so
    the forward must not allocate its (V, H) fp32 gradient buffer (1.2 GB for Qwen3-VL-2B's head)."""
    class Shapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.made = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                self.made.append((tuple(out.shape), out.dtype))
            return out

    hidden, head, labels = _case(n=40, seed=4)
    shapes = {(tuple(head.weight.shape), torch.float32), (tuple(hidden.shape), torch.float32)}
    for grad_mode, expected in ((False, set()), (True, shapes)):
        with torch.set_grad_enabled(grad_mode), Shapes() as probe:
            head_loss_sum(hidden.requires_grad_(True), head, labels, 8)
        assert shapes & set(probe.made) == expected, grad_mode


class _MostChunksAlive(TorchDispatchMode):
    """The most (rows, vocabulary) tensors alive at once (storages made under the mode; not `weight`'s views)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.vocab, self.weight = weight.shape[0], weight.untyped_storage().data_ptr()
        self.alive, self.most = set(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dim() == 2 and out.shape[-1] == self.vocab:
            storage = out.untyped_storage()
            if storage.data_ptr() not in self.alive | {self.weight}:  # in-place results, views: not new chunks
                self.alive.add(storage.data_ptr())
                self.most = max(self.most, len(self.alive))
                weakref.finalize(storage, self.alive.discard, storage.data_ptr())
        return out


def test_one_chunk_of_logits_alive_at_a_time():
    """The head's working memory is one chunk of fp32 logits (two for the log-probabilities, whose gradient needs
    the probabilities beside the log-probabilities): the previous chunk's are freed before the next are made."""
    hidden, head, labels = _case(n=64, h=16, v=257)
    with _MostChunksAlive(head.weight) as loss_probe:
        head_loss_sum(hidden.clone().requires_grad_(True), head, labels, chunk=8).backward()
    hidden = hidden.clone().requires_grad_(True)
    with _MostChunksAlive(head.weight) as log_probs_probe:
        log_probs, entropy = token_log_probs_and_entropy(hidden, head, labels, chunk=8)
        (log_probs.sum() + entropy.sum()).backward()
    assert (loss_probe.most, log_probs_probe.most) == (1, 2)


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


def test_nothing_of_vocabulary_size_but_the_weight_is_kept_for_backward():
    """The fused loss keeps no logits and no hidden states for backward: only its gradients."""
    hidden, head, labels = _case(n=64, h=16, v=257)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        head_loss_sum(hidden.requires_grad_(True), head, labels, chunk=8)
        token_log_probs_and_entropy(hidden, head, labels, chunk=8)
    assert all(257 not in shape or shape == tuple(head.weight.shape) for shape in saved), saved


def test_chunk_size_follows_the_slice_with_a_floor_and_a_ceiling():
    # fp32 logits ~ 32x the slice's hidden states, cut in equal chunks
    assert chunk_tokens(1000, 2048, 151936) == 500  # 2 equal chunks: the weight read ~V / 32H times per pass
    assert chunk_tokens(1000, 2048, 248320) == 334  # 3 for a larger vocabulary
    assert chunk_tokens(200, 2048, 151936) == 100  # the same share of a shorter slice: memory as 1/P
    assert chunk_tokens(50, 2048, 151936) == 50 >= MIN_CHUNK  # at least MIN_CHUNK tokens ...
    assert chunk_tokens(20, 2048, 151936) == 20  # ... or the whole slice
    largest = (1 << 30) // (4 * 151936)  # 1 GiB of fp32 logits
    assert chunk_tokens(8192, 2048, 151936) == 1639 <= largest  # equal chunks within the ceiling
    assert 0.99 * largest < chunk_tokens(10**6, 2048, 151936) <= largest
    assert chunk_tokens(10, 2048, 151936, configured=512) == 512


def _plain_log_probs(hidden, head, targets, temperature):
    logp = (head(hidden).float() / temperature).log_softmax(-1)
    valid = targets != IGNORE_INDEX
    picked = torch.where(valid, logp.gather(-1, targets.clamp(min=0)[:, None])[:, 0], 0.0)
    return picked, torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 6, 37])
def test_token_log_probs_and_entropy_equal_the_plain_ones(chunk, temperature):
    hidden, head, targets = _case(bias=True, seed=4)

    def run(fn):
        x = hidden.detach().clone().requires_grad_(True)
        head.zero_grad(set_to_none=True)
        logp, ent = fn(x)
        (logp * torch.linspace(-1, 1, len(logp))).sum().add(0.3 * ent.sum()).backward()
        return [logp.detach(), ent.detach(), x.grad, head.weight.grad, head.bias.grad]

    ours = run(lambda x: token_log_probs_and_entropy(x, head, targets, temperature, chunk))
    plain = run(lambda x: _plain_log_probs(x, head, targets, temperature))
    for a, b in zip(ours, plain):
        assert rel_err(a, b) <= 1e-5


def _grads(hidden, head):
    return [hidden.grad, head.weight.grad] + ([head.bias.grad] if head.bias is not None else [])


def _fused(x, head, labels):
    return head_loss_sum(x, head, labels, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_a_retained_graph_backwards_again_like_stock(scale, dtype):
    """`backward(retain_graph=True)` then `backward()`: the fused head accumulates the same gradients again, bit for
    bit, as stock's head does from its saved logits; both sums equal stock's."""
    hidden, head, labels = _case(bias=True, dtype=dtype)

    def twice(fn):
        x = hidden.detach().clone().requires_grad_(True)
        head.zero_grad(set_to_none=True)
        loss = fn(x, head, labels) * scale
        loss.backward(retain_graph=True)
        once = [g.clone() for g in _grads(x, head)]
        loss.backward()
        return once, _grads(x, head)

    (ours_once, ours), (_, plain) = twice(_fused), twice(_plain)
    for first, both in zip(ours_once, ours):
        assert torch.equal(both, 2 * first)
    for a, b in zip(ours, plain):
        assert rel_err(a, b) <= (1e-5 if dtype == torch.float32 else 2e-2)


def test_autograd_grad_twice_on_a_retained_graph_like_stock():
    hidden, head, labels = _case(bias=True, seed=2)
    x = hidden.clone().requires_grad_(True)
    inputs = [x, head.weight, head.bias]
    loss = _fused(x, head, labels) * 0.37
    first = torch.autograd.grad(loss, inputs, retain_graph=True)
    second = torch.autograd.grad(loss, inputs)
    plain = torch.autograd.grad(_plain(x, head, labels) * 0.37, inputs)
    for a, b, c in zip(first, second, plain):
        assert torch.equal(a, b) and rel_err(a, c) <= 1e-6


def test_a_second_backward_without_retain_graph_raises_like_stock():
    hidden, head, labels = _case()
    loss = _fused(hidden.requires_grad_(True), head, labels)  # the head's node is the graph's first
    loss.backward()
    with pytest.raises(RuntimeError, match="fused LM head a second time.*retain_graph=True"):
        loss.backward()


@pytest.mark.parametrize("what", ["loss", "log-probabilities"])
def test_second_order_gradients_are_refused_where_stock_gives_them(what):
    """Stock's head is differentiable twice; the chunked head's gradients are made without a graph, so
    `create_graph=True` raises instead of handing back constants."""
    hidden, head, labels = _case(bias=True, seed=5)

    def first_order(fn):
        x = hidden.detach().clone().requires_grad_(True)
        return torch.autograd.grad(fn(x), x, create_graph=True)[0]

    def plain(x):
        return _plain(x, head, labels) if what == "loss" else sum(map(torch.sum, _plain_log_probs(x, head, labels, 1.0)))

    def ours(x):
        return _fused(x, head, labels) if what == "loss" else sum(map(torch.sum, token_log_probs_and_entropy(
            x, head, labels, chunk=8)))

    assert first_order(plain).requires_grad  # the control: stock's gradient has a graph
    with pytest.raises(RuntimeError, match=rf"chunked LM head \({what}\) cannot be differentiated twice"):
        first_order(ours)


class _Buffers(TorchDispatchMode):
    """The storages of the given shapes made under the mode (not one of `before`), and which of them are alive."""

    def __init__(self, shapes, before=frozenset()):
        super().__init__()
        self.shapes, self.before, self.made, self.alive = set(shapes), before, 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and tuple(out.shape) in self.shapes:
            storage = out.untyped_storage()
            if storage.data_ptr() not in self.alive | self.before:  # in-place results: not new buffers
                self.made += 1
                self.alive.add(storage.data_ptr())
                weakref.finalize(storage, self.alive.discard, storage.data_ptr())
        return out


@pytest.mark.parametrize("retain", [False, True])
def test_the_stored_gradients_are_freed_at_backward_unless_the_graph_is_retained(retain):
    """One backward scales the stored gradients in place and hands them on — the weight's fp32 buffer becomes its
    .grad, no (V, H) copy — and the graph holds nothing after it. Under `retain_graph` the graph keeps them (and
    backward hands on copies) until it is freed."""
    hidden, head, labels = _case(n=64, h=16, v=257)
    x = hidden.clone().requires_grad_(True)
    shapes = (tuple(head.weight.shape), tuple(x.shape))
    with _Buffers(shapes) as forward:
        loss = _fused(x, head, labels) * 0.37
    stored = set(forward.alive)
    assert forward.made == len(stored) == 2
    with _Buffers(shapes, stored) as backward:
        loss.backward(retain_graph=retain)
    assert backward.made == (2 if retain else 0)
    assert (head.weight.grad.untyped_storage().data_ptr() in stored) is not retain
    head.weight.grad = x.grad = None
    assert forward.alive == (stored if retain else set())  # `loss` and its graph still referenced here
    del loss
    assert forward.alive == set()


def _retained_graph_under_cp(rank, world_size):
    """Stock P=1 and CP=`world_size` each: backward(retain_graph=True), then backward(); the loss and the
    gradients after each, the CP ones summed over the group (and this rank's own, for the control)."""
    import vlmcp_patch
    from vlmcp_patch.fixtures.compare import summed_over_group
    from vlmcp_patch.fixtures.data import Segment as S
    from vlmcp_patch.fixtures.data import make_batch
    from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_vl_config

    model = build_model(tiny_qwen3_vl_config())
    batch = make_batch([[S(text=5), S(image=(16, 16)), S(text=6)]], seed=1)

    def twice():
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward(retain_graph=True)
        once = {n: p.grad.clone() for n, p in model.named_parameters()}
        loss.backward()
        return loss.detach(), once, {n: p.grad.clone() for n, p in model.named_parameters()}

    stock = twice()
    vlmcp_patch.enable(cp_size=world_size)
    try:
        loss, once, both = twice()
    finally:
        vlmcp_patch.enable(cp_size=1)
    group = vlmcp_patch.get_cp_group(world_size).group
    return {"loss": rel_err(loss, stock[0]),
            "once": max(rel_err(g, stock[1][n]) for n, g in summed_over_group(once, group).items()),
            "twice": max(rel_err(g, stock[2][n]) for n, g in summed_over_group(both, group).items()),
            "own": max(rel_err(g, stock[2][n]) for n, g in both.items())}


def test_a_retained_graph_backwards_again_under_cp_like_stock():
    """The whole CP model (the fused head, the exchanges' backwards) backwards twice through a retained graph: the
    group's summed gradients after each backward equal stock P=1's (twice the gradient after the second)."""
    from tests.helpers.harness import run_distributed

    for res in run_distributed(_retained_graph_under_cp, 2, timeout=300):
        assert max(res["loss"], res["once"], res["twice"]) <= 1e-5, res
        assert res["own"] > 1e-5  # each rank holds only its slice's share: CP really ran
