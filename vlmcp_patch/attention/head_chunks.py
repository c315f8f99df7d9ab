"""Attention by head chunks (UPipe's idea, "Untied Ulysses", 2026, built for the package's own layouts).

Under CP each rank of a Ulysses subgroup turns its slice of the row (all heads) into its subgroup's share of the row
for H/U heads, runs the kernel (or the ring) and turns the output back (`ulysses.py`). At the longest rows that
whole-sequence q, k, v (and their exchange buffers, the output, and in backward their gradients) is the attention
layer's working set. With `VLMCP_HEAD_CHUNKS=N` the exchange, the attention and the exchange back run one chunk of
H/(U N) heads at a time:

* chunk c of rank r holds the heads of "virtual rank" r N + c of a Ulysses layout of U N ranks: each rank's chunk c
  takes the same heads of every slice, so one all-to-all of the chunk's heads over the subgroup delivers it. Key and
  value heads follow their query heads as they do across ranks (`heads.kv_replication` over U N): a chunk smaller
  than a query group gets its own copy of the group's key/value head, the gradients of the copies summed;
* forward (`_ByHeadChunks.forward`) keeps no graph: each chunk's output lands in its heads of one output buffer and
  everything else of the chunk is dropped before the next; only the slice's q, k, v (all heads, local tokens: the
  same bytes as one rank's whole-sequence heads) are saved;
* backward runs the chunks again one at a time: the chunk's exchange and attention forward (with a graph), the
  exchange of its output's gradient, the kernel's own backward, the exchange of q, k, v's gradients back, added into
  one gradient buffer per input. It is the kernel's forward recomputed once per backward (the price of never holding
  every chunk's saved tensors at once; docs/memory.md measures it).

Exact: every head's attention is the kernel's on the same values; the order of the additions of replicated key and
value heads' gradients is the only difference from the unchunked path. N = 1 takes the unchunked path itself. Every
rank issues the same collectives in the same order: the chunks in order, forward and backward, each chunk's
collectives in an order of their own (`CollectiveOrder`), the whole as one ordered collective of the layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..collectives.order import CollectiveOrder, new_token, ordered, remember_order, token_grad
from ..collectives.record import site
from ..errors import UnsupportedSetupError
from ..layout import kv_replication_factor


def head_chunk_problem(num_heads: int, ulysses: int, chunks: int, what: str = "softmax attention",
                       heads: str = "query") -> str | None:
    """Why `chunks` head chunks cannot split the `num_heads // ulysses` heads of each rank (None where they can)."""
    if chunks == 1 or num_heads % ulysses:
        return None  # nothing chunked, or the layout's own check refuses it
    per_rank = num_heads // ulysses
    if per_rank % chunks == 0:
        return None
    fits = [n for n in range(1, per_rank + 1) if per_rank % n == 0]
    return (f"{what}: VLMCP_HEAD_CHUNKS={chunks} does not divide the {per_rank} {heads} heads each rank holds "
            f"({num_heads} heads over a Ulysses degree of {ulysses}); choose one of {fits}")


def check_head_chunks(text_config, ulysses: int, chunks: int) -> None:
    """Raise `UnsupportedSetupError` when `chunks` head chunks do not divide each rank's query heads. Config only: the
    same verdict on every rank, before any compute (`heads.ulysses_of`, which the forward's checks call first)."""
    problem = head_chunk_problem(text_config.num_attention_heads, ulysses, chunks)
    if problem is not None:
        raise UnsupportedSetupError(problem)


def chunk_heads(num_heads: int, ulysses: int, chunks: int) -> list[torch.Tensor]:
    """For each chunk, the heads (of all `num_heads`, as a rank holds them before the exchange) that the chunk's
    all-to-all sends: rank j's share of chunk c, for j = 0 .. U-1 in order (the all-to-all sends its j-th part to
    rank j)."""
    per_chunk = num_heads // (ulysses * chunks)
    return [torch.tensor([(j * chunks + c) * per_chunk + i for j in range(ulysses) for i in range(per_chunk)])
            for c in range(chunks)]


def chunk_kv_heads(num_heads: int, num_kv_heads: int, ulysses: int, chunks: int) -> list[torch.Tensor]:
    """`chunk_heads` for the key/value heads of grouped-query attention: the KV heads of each chunk's query heads,
    replicated as a Ulysses layout of U x chunks ranks replicates them (`layout.kv_replication_factor`). Indices of
    the original KV heads (a replicated one appears in several chunks)."""
    repeat = kv_replication_factor(num_heads, num_kv_heads, ulysses * chunks)
    per_chunk = num_kv_heads * repeat // (ulysses * chunks)
    return [torch.tensor([((j * chunks + c) * per_chunk + i) // repeat for j in range(ulysses)
                          for i in range(per_chunk)]) for c in range(chunks)]


@dataclass(frozen=True)
class ChunkPlan:
    """How a function of local tensors runs by chunks of heads.

    `run(*pieces)` computes one chunk's output from its pieces (collectives allowed: differentiable and ordered);
    `inputs[i]` is the (dim, per-chunk indices) of input i taken for each chunk, or None for an input passed whole
    (a parameter: its gradient is the sum over the chunks); `output` is the (dim, per-chunk indices) where each chunk's
    output lands (a partition of the output's heads)."""

    run: Callable[..., torch.Tensor]
    inputs: tuple[tuple[int, Sequence[torch.Tensor]] | None, ...]
    output: tuple[int, Sequence[torch.Tensor]]

    @property
    def count(self) -> int:
        return len(self.output[1])

    def pieces(self, chunk: int, tensors) -> list[torch.Tensor]:
        return [t if how is None else t.index_select(how[0], how[1][chunk].to(t.device))
                for t, how in zip(tensors, self.inputs)]

    def place(self, out: torch.Tensor | None, chunk: int, piece: torch.Tensor) -> torch.Tensor:
        dim, index = self.output
        if out is None:
            shape = list(piece.shape)
            shape[dim] = sum(len(i) for i in index)
            out = piece.new_empty(shape)
        return out.index_copy_(dim, index[chunk].to(out.device), piece)

    def take(self, grad: torch.Tensor, chunk: int) -> torch.Tensor:
        dim, index = self.output
        return grad.index_select(dim, index[chunk].to(grad.device))

    def add(self, total: torch.Tensor, chunk: int, i: int, grad: torch.Tensor) -> None:
        how = self.inputs[i]
        if how is None:
            total += grad
        else:
            total.index_add_(how[0], how[1][chunk].to(total.device), grad.to(total.dtype))


class _ByHeadChunks(torch.autograd.Function):
    """The chunks of `plan` one at a time (module docstring). Ordered: its backward's collectives run in their place
    of the layer's order, chunk after chunk, on every rank."""

    @staticmethod
    def forward(ctx, plan: ChunkPlan, *args):
        *tensors, token = args
        out = None
        for chunk in range(plan.count):  # no graph here: autograd runs a Function's forward without one
            out = plan.place(out, chunk, plan.run(*plan.pieces(chunk, tensors)))
        ctx.plan = plan
        ctx.save_for_backward(*tensors)
        remember_order(ctx, token)
        return out, new_token(out)

    @staticmethod
    def backward(ctx, grad, grad_token):
        tensors = ctx.saved_tensors
        wants = ctx.needs_input_grad[1:1 + len(tensors)]
        if not any(wants):
            return (None, *(None,) * len(tensors), token_grad(ctx, grad_token))
        plan = ctx.plan
        totals = [torch.zeros_like(t) if want else None for t, want in zip(tensors, wants)]
        with site(ctx.site), torch.enable_grad():
            for chunk in range(plan.count):
                pieces = [p.detach().requires_grad_(want) for p, want in zip(plan.pieces(chunk, tensors), wants)]
                order = CollectiveOrder()  # the chunk's own collectives, in one order on every rank
                with order.running():
                    out = plan.run(*pieces)
                out = order.tie(out)
                needed = [p for p, want in zip(pieces, wants) if want]
                grads = torch.autograd.grad(out, needed, plan.take(grad, chunk), allow_unused=True)
                del out, pieces
                grads = iter(grads)
                for i, want in enumerate(wants):
                    if want:
                        g = next(grads)
                        if g is not None:
                            plan.add(totals[i], chunk, i, g)
        return (None, *totals, token_grad(ctx, grad_token))


def by_head_chunks(plan: ChunkPlan, *tensors: torch.Tensor) -> torch.Tensor:
    """`plan`'s chunks run one at a time (`_ByHeadChunks`), as the next collective of the running order."""
    return ordered(_ByHeadChunks, plan, *tensors)
