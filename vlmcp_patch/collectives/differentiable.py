"""Differentiable collectives over the CP group, each with the gradient contract it implements.

The package-wide rule: every rank calls `backward()` on its own copy of the same scalar loss, and a parameter's
gradient *summed over the CP group* is the full gradient. Each collective is chosen so that no contribution is
counted twice and none is dropped. Those that communicate in backward are ordered (`order.ordered`: they take and
return the forward's order token); the loss's sum and the logits' gather do not communicate in backward and need no
token. Every communication goes through `communication.communicate` (errors, timeouts, the debug record).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .communication import all_gather_along, communicate, torch_collective
from .order import differentiable_like_input, new_token, ordered, remember_order, token_grad
from .record import current_site, site
from ..grad_shares import shares_of


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group, size: int) -> torch.Tensor:
    """Split `x` in `size` chunks along `scatter_dim`, send chunk j to rank j, concat received along `gather_dim`.

    Three allocations of `x`'s size, two of them held here at once: the send buffer is one copy of `x` with the
    chunks first, dropped before the output is laid out from the receive buffer (a send buffer built from chunk
    copies and kept to the end held three; the largest exchange of a layer sits in its recomputed working set). The
    backend may hold the send buffer a little longer: gloo's worker lets go of it when it is done."""
    if x.shape[scatter_dim] % size:
        raise ValueError(f"dimension {scatter_dim} of size {x.shape[scatter_dim]} cannot be split over {size} ranks")
    send = x.unflatten(scatter_dim, (size, -1)).movedim(scatter_dim, 0).contiguous()
    recv = torch.empty_like(send)
    communicate("all-to-all", group, send.numel(), lambda: dist.all_to_all_single(recv, send, group=group))
    del send
    return recv.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1).contiguous()


class _AllToAll(torch.autograd.Function):
    """Sequence-sharded <-> head-sharded exchange. Its adjoint is the reverse exchange; ordered."""

    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group, size, token):
        ctx.dims, ctx.group, ctx.size = (scatter_dim, gather_dim), group, size
        remember_order(ctx, token)
        return differentiable_like_input(ctx, _all_to_all(x, scatter_dim, gather_dim, group, size)), new_token(x)

    @staticmethod
    def backward(ctx, grad, grad_token):
        scatter_dim, gather_dim = ctx.dims
        if not ctx.needs_input_grad[0]:
            grad = None
        else:
            with site(ctx.site):
                grad = _all_to_all(grad.contiguous(), gather_dim, scatter_dim, ctx.group, ctx.size)
        return grad, None, None, None, None, token_grad(ctx, grad_token)


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group, size: int) -> torch.Tensor:
    if size == 1:
        return x
    return ordered(_AllToAll, x, scatter_dim, gather_dim, group, size)


def _reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """x (size, *block) on every member -> (*block): the sum over the members of x[this member's group rank]."""
    flat = x.contiguous().view(-1)
    out = x.new_empty(x.shape[1:])
    run = torch_collective("reduce_scatter_single", "reduce_scatter_tensor")
    communicate("reduce-scatter", group, flat.numel(), lambda: run(out.view(-1), flat, group=group))
    return out


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    communicate("all-reduce", group, x.numel(), lambda: dist.all_reduce(x, group=group))
    return x


class _GatherKeepLocalGrad(torch.autograd.Function):
    """All-gather along `dim`; backward keeps this rank's slice of the gradient, with no communication.

    Every rank is assumed to compute the same function of the gathered tensor (for example the same
    loss from gathered logits). Each rank then back-propagates only through its own slice, so the
    gradients summed over the group count every position exactly once.
    """

    @staticmethod
    def forward(ctx, x, dim, group, size, rank):
        ctx.dim, ctx.size, ctx.rank = dim, size, rank
        return all_gather_along(x, dim, group, size)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.size, dim=ctx.dim)[ctx.rank].contiguous(), None, None, None, None


def gather_keep_local_grad(x: torch.Tensor, dim: int, group, size: int, rank: int) -> torch.Tensor:
    if size == 1:
        return x
    return _gather_keep_local_grad(x, dim, group, size, rank)


# The two keep-local-grad functions run eagerly under torch.compile: traced by Dynamo (torch 2.11), the loss's
# all-reduce came out with no gradient path, every parameter's gradient zero under CP (tests/test_compile.py on 2.11;
# 2.13 traces it right). Their hook (`shares_of`) and collective gain nothing from a graph.
@torch.compiler.disable
def _gather_keep_local_grad(x: torch.Tensor, dim: int, group, size: int, rank: int) -> torch.Tensor:
    return shares_of(_GatherKeepLocalGrad.apply(x, dim, group, size, rank))


class _SumKeepLocalGrad(torch.autograd.Function):
    """All-reduce (sum) whose backward is the identity.

    Used for the loss: the value is the group's total on every rank, and each rank seeds gradient
    only into its own share of it, so the group's gradients add up to the gradient of the total.
    """

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.detach().clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def sum_keep_local_grad(x: torch.Tensor, group, size: int) -> torch.Tensor:
    if size == 1:
        return x
    return _sum_keep_local_grad(x, group)


@torch.compiler.disable  # eager under torch.compile (see `_gather_keep_local_grad`)
def _sum_keep_local_grad(x: torch.Tensor, group) -> torch.Tensor:
    return shares_of(_SumKeepLocalGrad.apply(x, group))


class _GatherOverGroup(torch.autograd.Function):
    """Every member's `x` stacked in rank order: (size, *x.shape). Each member uses all of them differently (a
    ring's halos and state transfers), so backward sums the gradient over the group and keeps this member's block —
    one reduce-scatter (half an all-reduce's traffic, which would hand every member every block); ordered: a member
    that uses none of them still joins it."""

    @staticmethod
    def forward(ctx, x, group, size, token):
        ctx.group = group
        remember_order(ctx, token)
        return differentiable_like_input(ctx, all_gather_along(x.unsqueeze(0), 0, group, size)), new_token(x)

    @staticmethod
    def backward(ctx, grad, grad_token):
        if not ctx.needs_input_grad[0]:
            return None, None, None, token_grad(ctx, grad_token)
        with site(ctx.site):
            grad = _reduce_scatter(grad, ctx.group)
        return grad, None, None, token_grad(ctx, grad_token)


def gather_over_group(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """See `_GatherOverGroup`."""
    if size == 1:
        return x.unsqueeze(0)
    return ordered(_GatherOverGroup, x, group, size)


class _ExchangeRows(torch.autograd.Function):
    """Rows sent to other ranks by count: rank r sends its first `send_counts[0]` rows to rank 0, the next
    `send_counts[1]` to rank 1, ..., and receives `recv_counts[s]` rows from each rank s, in rank order (one
    all_to_all_single with uneven splits; a rank with nothing to send or receive still takes part, with zero rows).
    Every row goes to exactly one rank, so the adjoint is the same exchange in reverse: each rank gets back the
    gradient of the rows it sent. Ordered: its backward runs on every rank, also where the rows received are used by
    nothing."""

    @staticmethod
    def forward(ctx, x, send_counts, recv_counts, group, token):
        ctx.counts, ctx.group = (send_counts, recv_counts), group
        remember_order(ctx, token)
        return differentiable_like_input(ctx, _exchange_rows(x, send_counts, recv_counts, group)), new_token(x)

    @staticmethod
    def backward(ctx, grad, grad_token):
        send_counts, recv_counts = ctx.counts
        if not ctx.needs_input_grad[0]:
            grad = None
        else:
            with site(ctx.site):
                grad = _exchange_rows(grad, recv_counts, send_counts, ctx.group)
        return grad, None, None, None, token_grad(ctx, grad_token)


def _exchange_rows(x: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
    if sum(send_counts) != x.shape[0]:  # this rank's own mistake: named here, before any rank waits for it
        raise ValueError(f"vlmcp-patch: the uneven all-to-all at {current_site() or 'the CP forward'} was given "
                         f"{x.shape[0]} rows to send but send counts {send_counts} that add up to {sum(send_counts)}")
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    width = math.prod(x.shape[1:])
    communicate("uneven all-to-all (rows)", group, width,
                lambda: dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=group))
    return out


def exchange_rows(x: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
    """See `_ExchangeRows`; `x` holds sum(send_counts) rows grouped by destination rank."""
    return ordered(_ExchangeRows, x, send_counts, recv_counts, group)
