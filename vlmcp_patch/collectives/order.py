"""One order of every rank's collectives, so that nothing hangs.

A collective completes only when every member of its group issues it, so every rank of a CP group must issue the
same collectives in the same order, in forward and in backward, whatever its slice holds. Forward code is
sequential: it does so when no collective is skipped for want of data (an empty share still sends and receives zero
rows). Backward is scheduled by the autograd engine, which runs a node only if the loss depends on its outputs, and
orders independent branches by how the graph was built — which differs between ranks whose slices hold different
things (a rank whose DeltaNet chunk starts a new sample does not use the state passed to it; a rank without image
tokens does not use the features routed to it). So:

1. every differentiable collective of a CP forward takes the forward's *order token* (a zero scalar) as an input
   and returns a new one (`ordered`); the text decoder adds the last token (a view: exact, no copy) to its output
   (`CollectiveOrder.tie`). Each collective's backward is then reachable from the loss on every rank — its result
   always enters the graph, with a zero gradient where nothing else used it — and
2. it cannot run before the collective issued after it has run its backward (it waits for the token's gradient):
   the backward collectives run in exactly the reverse of the forward order, on every rank, one chain through the
   whole forward (the vision exchange, every layer's all-to-alls, ring passes and state gathers).

A layer recomputed by gradient checkpointing (outside the forward) orders its collectives the same way within the
layer (`run_ordered`). Collectives that do not communicate in backward (the loss's sum, the logits' gather) need no
token. An ordered function's backward communicates only where its input needs a gradient
(`differentiable_like_input`), which is the same on every rank.
"""

from __future__ import annotations

import contextvars

import torch

from ..settings import SETTINGS
from .communication import check_collectives
from .record import current_site, reset_on_exit

_ORDER: contextvars.ContextVar[CollectiveOrder | None] = contextvars.ContextVar("vlmcp_collective_order",
                                                                                 default=None)


class CollectiveOrder:
    """The chain of order tokens of one CP forward (module docstring, rule 1). `CPContext.running()` makes it current
    while the backbone runs; the text decoder ties its last token into its output."""

    def __init__(self, group=None, size: int = 1):
        self.token: torch.Tensor | None = None
        self.group, self.size = group, size  # the CP group, for the debug comparisons

    def running(self):
        return reset_on_exit(_ORDER, _ORDER.set(self))

    def tie(self, x: torch.Tensor) -> torch.Tensor:
        """`x` (a view of it) depending on the last token: every collective before it runs its backward, in order, once
        the gradient of `x` arrives. Without a token (no differentiable collective, or no grad) `x` itself."""
        if self.token is None or not torch.is_grad_enabled():
            return x
        token, self.token = self.token, None
        return _Tie.apply(x, token, self)

    def check(self, when: str) -> None:
        check_collectives(self.group, self.size, when)


class _Tie(torch.autograd.Function):
    """x, depending on the order's last token: a view of x (no copy of the hidden states); backward passes the
    gradient of x through and a zero gradient to the token, on the token's device (a model spread over devices by
    `device_map` may end elsewhere than its first collective ran), and (debug mode) compares the ranks' backward
    collectives once the whole backward is done."""

    @staticmethod
    def forward(ctx, x, token, order: CollectiveOrder):
        ctx.order, ctx.token_device = order, token.device
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if SETTINGS.debug_collectives:
            order = ctx.order
            torch.autograd.Variable._execution_engine.queue_callback(lambda: order.check("in backward"))
        return grad, torch.zeros((), dtype=torch.float32, device=ctx.token_device), None


def ordered(function: type[torch.autograd.Function], *args):
    """`function.apply(*args, token)` as the next collective of the running order (rule 2 of the module docstring):
    `function` takes the order token (or None) as its last input and returns its outputs and a new token last; its
    backward returns the token's gradient (None where it got None). Returns the outputs without the token."""
    order = _ORDER.get()
    token = order.token if order is not None and torch.is_grad_enabled() else None
    *outs, new_token = function.apply(*args, token)
    if order is not None and new_token.requires_grad:
        order.token = new_token
    return outs[0] if len(outs) == 1 else tuple(outs)


def new_token(like: torch.Tensor) -> torch.Tensor:
    """A function's outgoing order token."""
    return like.new_zeros((), dtype=torch.float32)


def remember_order(ctx, token) -> None:
    """What an ordered function's backward needs of its forward: whether it was given a token, and its site."""
    ctx.had_token, ctx.site = token is not None, current_site()


def differentiable_like_input(ctx, out: torch.Tensor) -> torch.Tensor:
    """`out` of an ordered function whose first input is the tensor it communicates, marked not differentiable when
    that input needs no gradient (a frozen layer's keys): its backward then does not communicate. Whether an input
    needs a gradient follows from which parameters train and the code path, never from a slice's data: the same on
    every rank."""
    if not ctx.needs_input_grad[0]:
        ctx.mark_non_differentiable(out)
    return out


def token_grad(ctx, grad_token: torch.Tensor):
    """The gradient a function returns for its incoming order token (None where it was given none)."""
    return grad_token if ctx.had_token else None


def run_ordered(fn, *args, **kwargs) -> torch.Tensor:
    """`fn(*args, **kwargs)` -> a tensor, its collectives ordered: inside a CP forward as part of its order; outside
    one (a layer recomputed by gradient checkpointing), as an order of their own tied into `fn`'s output."""
    if _ORDER.get() is not None or not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    order = CollectiveOrder()
    with order.running():
        out = fn(*args, **kwargs)
    return order.tie(out)
