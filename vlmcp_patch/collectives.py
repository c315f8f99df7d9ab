"""Differentiable collectives over the CP group.

Each autograd function states the gradient contract it implements. The package-wide rule is: every
rank calls `backward()` on its own copy of the same scalar loss, and a parameter's gradient *summed
over the CP group* is the full gradient. Collectives are chosen so that no contribution is counted
twice and none is dropped.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _split_contiguous(x: torch.Tensor, parts: int, dim: int) -> list[torch.Tensor]:
    return [c.contiguous() for c in x.chunk(parts, dim=dim)]


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group, size: int) -> torch.Tensor:
    """Split `x` in `size` chunks along `scatter_dim`, send chunk j to rank j, concat received along `gather_dim`."""
    if x.shape[scatter_dim] % size:
        raise ValueError(f"dimension {scatter_dim} of size {x.shape[scatter_dim]} cannot be split over {size} ranks")
    send = torch.stack(_split_contiguous(x, size, scatter_dim))
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """Sequence-sharded <-> head-sharded exchange. Its adjoint is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group, size):
        ctx.dims, ctx.group, ctx.size = (scatter_dim, gather_dim), group, size
        return _all_to_all(x, scatter_dim, gather_dim, group, size)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad.contiguous(), gather_dim, scatter_dim, ctx.group, ctx.size), None, None, None, None


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group, size: int) -> torch.Tensor:
    if size == 1:
        return x
    return _AllToAll.apply(x, scatter_dim, gather_dim, group, size)


def _collective(name: str, before_2_13: str):
    """torch 2.13 renames all_gather_into_tensor / reduce_scatter_tensor (deprecated there) to the *_single names.
    Looked up at each call, as torch.distributed's functions are (the collective probes wrap them there)."""
    return getattr(dist, name, None) or getattr(dist, before_2_13)


def _all_gather_along(x: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    """Every rank's `x` (the same shape everywhere) concatenated along `dim` in rank order: one
    all_gather_into_tensor."""
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((size * front.shape[0], *front.shape[1:]))
    _collective("all_gather_single", "all_gather_into_tensor")(out, front, group=group)
    return out.movedim(0, dim)


class _GatherKeepLocalGrad(torch.autograd.Function):
    """All-gather along `dim`; backward keeps this rank's slice of the gradient, with no communication.

    Every rank is assumed to compute the same function of the gathered tensor (for example the same
    loss from gathered logits). Each rank then back-propagates only through its own slice, so the
    gradients summed over the group count every position exactly once.
    """

    @staticmethod
    def forward(ctx, x, dim, group, size, rank):
        ctx.dim, ctx.size, ctx.rank = dim, size, rank
        return _all_gather_along(x, dim, group, size)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.size, dim=ctx.dim)[ctx.rank].contiguous(), None, None, None, None


def gather_keep_local_grad(x: torch.Tensor, dim: int, group, size: int, rank: int) -> torch.Tensor:
    if size == 1:
        return x
    return _GatherKeepLocalGrad.apply(x, dim, group, size, rank)


class _SumKeepLocalGrad(torch.autograd.Function):
    """All-reduce (sum) whose backward is the identity.

    Used for the loss: the value is the group's total on every rank, and each rank seeds gradient
    only into its own share of it, so the group's gradients add up to the gradient of the total.
    """

    @staticmethod
    def forward(ctx, x, group):
        out = x.detach().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def sum_keep_local_grad(x: torch.Tensor, group, size: int) -> torch.Tensor:
    if size == 1:
        return x
    return _SumKeepLocalGrad.apply(x, group)


class _GatherOverGroup(torch.autograd.Function):
    """Every member's `x` stacked in rank order: (size, *x.shape). Each member uses all of them differently (a
    ring's halos and state transfers), so backward sums the gradient over the group and keeps this member's block."""

    @staticmethod
    def forward(ctx, x, group, size, rank):
        ctx.group, ctx.rank = group, rank
        return _all_gather_along(x.unsqueeze(0), 0, group, size)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None, None, None


def gather_over_group(x: torch.Tensor, group, size: int, rank: int) -> torch.Tensor:
    """See `_GatherOverGroup`."""
    if size == 1:
        return x.unsqueeze(0)
    return _GatherOverGroup.apply(x, group, size, rank)


class _ExchangeRows(torch.autograd.Function):
    """Rows sent to other ranks by count: rank r sends its first `send_counts[0]` rows to rank 0, the next
    `send_counts[1]` to rank 1, ..., and receives `recv_counts[s]` rows from each rank s, in rank order (one
    all_to_all_single with uneven splits). Every row goes to exactly one rank, so the adjoint is the same
    exchange in reverse: each rank gets back the gradient of the rows it sent."""

    @staticmethod
    def forward(ctx, x, send_counts, recv_counts, group):
        ctx.counts, ctx.group = (send_counts, recv_counts), group
        return _exchange_rows(x, send_counts, recv_counts, group)

    @staticmethod
    def backward(ctx, grad):
        send_counts, recv_counts = ctx.counts
        return _exchange_rows(grad, recv_counts, send_counts, ctx.group), None, None, None


def _exchange_rows(x: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=group)
    return out


def exchange_rows(x: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
    """See `_ExchangeRows`; `x` holds sum(send_counts) rows grouped by destination rank."""
    return _ExchangeRows.apply(x, send_counts, recv_counts, group)


def all_gather_small(values: torch.Tensor, group, size: int) -> torch.Tensor:
    """Gather a small 1-D tensor from every rank of the group (no autograd): shape (size, n)."""
    return _all_gather_along(values, 0, group, size).view(size, -1)
