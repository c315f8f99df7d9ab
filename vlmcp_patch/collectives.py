"""Differentiable collectives over the CP group, and the rule that keeps every rank's collectives in one order.

**Gradients.** Each autograd function states the gradient contract it implements. The package-wide rule is: every
rank calls `backward()` on its own copy of the same scalar loss, and a parameter's gradient *summed over the CP
group* is the full gradient. Collectives are chosen so that no contribution is counted twice and none is dropped.

**One order on every rank** (nothing hangs). A collective completes only when every member of its group issues it,
so every rank of a CP group must issue the same collectives in the same order, in forward and in backward,
whatever its slice holds. Forward code is sequential: it does so when no collective is skipped for want of data (an
empty share still sends and receives zero rows). Backward is scheduled by the autograd engine, which runs a node
only if the loss depends on its outputs, and orders independent branches by how the graph was built — which
differs between ranks whose slices hold different things (a rank whose DeltaNet chunk starts a new sample does not
use the state passed to it; a rank without image tokens does not use the features routed to it). So:

1. every differentiable collective of a CP forward takes the forward's *order token* (a zero scalar) as an input
   and returns a new one (`ordered`); the text decoder adds the last token (+0.0, exact) to its output
   (`CollectiveOrder.tie`). Each collective's backward is then reachable from the loss on every rank — its result
   always enters the graph, with a zero gradient where nothing else used it — and
2. it cannot run before the collective issued after it has run its backward (it waits for the token's gradient):
   the backward collectives run in exactly the reverse of the forward order, on every rank, one chain through the
   whole forward (the vision exchange, every layer's all-to-alls, ring passes and state gathers).

A layer recomputed by gradient checkpointing (outside the forward) orders its collectives the same way within the
layer (`run_ordered`). Collectives that do not communicate in backward (the loss's sum, the logits' gather) need no
token.

**Failures become errors.** Every communication goes through `_communicate`: a backend error or a collective that
does not complete within the CP groups' timeout (`VLMCP_TIMEOUT`, else the user's) raises `CollectiveError`
naming the collective, the layer (`site`) and the phase, on every rank that can raise.

**A check that sees order.** With `VLMCP_DEBUG_COLLECTIVES=1` each rank records every collective (phase, operation,
group, element count, site); after each CP forward and each backward the ranks compare what they recorded since
the last comparison (one small all-gather) and, on a difference, every rank raises naming the first one
(`CollectiveLog`). Off, nothing is recorded.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .errors import CollectiveError
from .grad_shares import shares_of
from .settings import SETTINGS

# ---------------------------------------------------------------------------------------------------------
# Where a collective runs, what it is, and the debug record of the sequence

_SITE: contextvars.ContextVar[str] = contextvars.ContextVar("vlmcp_collective_site", default="")


def site(name: str):
    """Name the part of the model whose collectives run in the block (e.g. "layer 3 (Qwen3_5GatedDeltaNet)"):
    errors and debug records carry it, and so does the backward of each differentiable collective issued there."""
    token = _SITE.set(name)
    return _reset_on_exit(_SITE, token)


def module_site(module) -> str:
    """The site name of a module's collectives: its class, and its layer where it has one."""
    layer = getattr(module, "layer_idx", None)
    return type(module).__name__ + ("" if layer is None else f" of layer {layer}")


@contextlib.contextmanager
def _reset_on_exit(var: contextvars.ContextVar, token):
    try:
        yield
    finally:
        var.reset(token)


def _group_name(group) -> str:
    """The group's role (`distributed` creates them with a description: cp, ulysses, ring) and its size."""
    role = getattr(group, "group_desc", None) or "group"
    return f"{role}[{dist.get_world_size(group)}]"


def _phase() -> str:
    return "backward" if torch._C._current_graph_task_id() != -1 else "forward"


@dataclass(frozen=True)
class Record:
    """One collective as a rank issued it. `count`: the elements every member of the group moves alike (uneven
    exchanges: the width of a row)."""

    phase: str
    op: str
    group: str
    count: int
    where: str

    def __str__(self) -> str:
        return f"{self.phase} {self.op} over {self.group}, {self.count} elements, at {self.where or 'the CP forward'}"


@dataclass
class CollectiveLog:
    """This rank's collectives since the ranks last compared them (`VLMCP_DEBUG_COLLECTIVES=1`)."""

    records: list[Record] = field(default_factory=list)
    compared: int = 0  # how many records the ranks have agreed on so far

    def add(self, record: Record) -> None:
        self.records.append(record)

    def compare(self, group, size: int, when: str) -> None:
        """Compare the records since the last comparison with the other members of `group` (every member calls
        this at the same point); on a difference raise on every member, naming the first one."""
        if size == 1:  # nothing to compare with: the records wait for the CP group's next check
            return
        pending = [str(r) for r in self.records[self.compared :]]
        self.compared = len(self.records)
        # gathered as objects: torch puts them on the device the group's backend takes (CPU for gloo, GPU for NCCL)
        everyone = [None] * size
        mine = (len(pending), zlib.crc32("\n".join(pending).encode()))
        _raising("debug check's all-gather", group, lambda: dist.all_gather_object(everyone, mine, group=group))
        if len(set(everyone)) == 1:
            return
        sequences = [None] * size
        _raising("debug check's all-gather", group, lambda: dist.all_gather_object(sequences, pending, group=group))
        raise CollectiveError(_first_difference(sequences, when))


def _first_difference(sequences: list[list[str]], when: str) -> str:
    longest = max(len(s) for s in sequences)
    for i in range(longest):
        seen = [s[i] if i < len(s) else "nothing" for s in sequences]
        if len(set(seen)) > 1:
            issued = "; ".join(f"rank {r}: {what}" for r, what in enumerate(seen))
            return (f"vlmcp-patch: the ranks of a CP group issued different collectives {when} (collective {i + 1} "
                    f"of the step differs — {issued}). Ranks that issue different collectives hang; please report "
                    "this with the batch's layout.")
    raise AssertionError("unreachable: the sequences differ")


_LOG = CollectiveLog()


def collective_log() -> CollectiveLog:
    """This rank's record of its collectives (filled only with `VLMCP_DEBUG_COLLECTIVES=1`)."""
    return _LOG


def check_collectives(group, size: int, when: str = "since the last check") -> None:
    """With `VLMCP_DEBUG_COLLECTIVES=1`, compare this rank's collectives since the last comparison with the other
    members of the CP group `group` (collective: every member calls it); raises `CollectiveError` on every member
    at the first difference. Off, nothing."""
    if SETTINGS.debug_collectives:
        _LOG.compare(group, size, when)


def _communicate(op: str, group, count: int, run):
    """Run one communication `run()` of the CP group `group`: recorded in debug mode; a failure or a timeout raises
    `CollectiveError` naming it (module docstring)."""
    if SETTINGS.debug_collectives:
        _LOG.add(Record(_phase(), op, _group_name(group), count, _SITE.get()))
    return _raising(op, group, run)


def _raising(op: str, group, run):
    """`run()`, a backend error or timeout raised as `CollectiveError` naming the communication `op` (not recorded:
    the wait of a communication `_communicate` started)."""
    try:
        return run()
    except RuntimeError as error:  # gloo's and NCCL's errors (DistBackendError is one), timeouts included
        raise CollectiveError(
            f"vlmcp-patch: the {op} over the {_group_name(group)} group at {_SITE.get() or 'the CP forward'} "
            f"({_phase()}) did not complete on global rank {dist.get_rank()}: {error}. Another rank of the group "
            "failed, exited or did not reach the same collective within the CP groups' timeout (VLMCP_TIMEOUT, or "
            "the timeout given to init_process_group). VLMCP_DEBUG_COLLECTIVES=1 compares every rank's collectives "
            "after each forward and backward."
        ) from error


def _collective(name: str, before_2_13: str):
    """torch.distributed's collective `name`, or its name before torch 2.13 renamed it (deprecating the old one);
    looked up at each call, as torch.distributed's functions are (the collective probes wrap them there)."""
    return getattr(dist, name, None) or getattr(dist, before_2_13)


def _all_gather_raw(out: torch.Tensor, x: torch.Tensor, group) -> None:
    _collective("all_gather_single", "all_gather_into_tensor")(out, x, group=group)


# ---------------------------------------------------------------------------------------------------------
# The order of one CP forward's collectives

_ORDER: contextvars.ContextVar[CollectiveOrder | None] = contextvars.ContextVar("vlmcp_collective_order",
                                                                                 default=None)


class CollectiveOrder:
    """The chain of order tokens of one CP forward (module docstring, rule 1). `CPContext.running()` makes it current
    while the backbone runs; the text decoder ties its last token into its output."""

    def __init__(self, group=None, size: int = 1):
        self.token: torch.Tensor | None = None
        self.group, self.size = group, size  # the CP group, for the debug comparisons

    def running(self):
        return _reset_on_exit(_ORDER, _ORDER.set(self))

    def tie(self, x: torch.Tensor) -> torch.Tensor:
        """`x` (+0.0) depending on the last token: every collective before it runs its backward, in order, once the
        gradient of `x` arrives. Without a token (no differentiable collective, or no grad) `x` itself."""
        if self.token is None or not torch.is_grad_enabled():
            return x
        token, self.token = self.token, None
        return _Tie.apply(x, token, self)

    def check(self, when: str) -> None:
        check_collectives(self.group, self.size, when)


class _Tie(torch.autograd.Function):
    """x + 0 that depends on the order's last token: backward passes the gradient of x through and a zero gradient
    to the token, and (debug mode) compares the ranks' backward collectives once the whole backward is done."""

    @staticmethod
    def forward(ctx, x, token, order: CollectiveOrder):
        ctx.order = order
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if SETTINGS.debug_collectives:
            order = ctx.order
            torch.autograd.Variable._execution_engine.queue_callback(lambda: order.check("in backward"))
        return grad, torch.zeros((), dtype=torch.float32, device=grad.device), None


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
    ctx.had_token, ctx.site = token is not None, _SITE.get()


def needs_grad(ctx, out: torch.Tensor) -> torch.Tensor:
    """`out` of an ordered function whose first input is the tensor it communicates: not differentiable when that
    input needs no gradient (a frozen layer's keys), and then its backward does not communicate. Whether an input
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


# ---------------------------------------------------------------------------------------------------------
# The collectives


def _split_contiguous(x: torch.Tensor, parts: int, dim: int) -> list[torch.Tensor]:
    return [c.contiguous() for c in x.chunk(parts, dim=dim)]


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group, size: int) -> torch.Tensor:
    """Split `x` in `size` chunks along `scatter_dim`, send chunk j to rank j, concat received along `gather_dim`."""
    if x.shape[scatter_dim] % size:
        raise ValueError(f"dimension {scatter_dim} of size {x.shape[scatter_dim]} cannot be split over {size} ranks")
    send = torch.stack(_split_contiguous(x, size, scatter_dim))
    recv = torch.empty_like(send)
    _communicate("all-to-all", group, send.numel(), lambda: dist.all_to_all_single(recv, send, group=group))
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """Sequence-sharded <-> head-sharded exchange. Its adjoint is the reverse exchange; ordered (module docstring)."""

    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group, size, token):
        ctx.dims, ctx.group, ctx.size = (scatter_dim, gather_dim), group, size
        remember_order(ctx, token)
        return needs_grad(ctx, _all_to_all(x, scatter_dim, gather_dim, group, size)), new_token(x)

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


def _all_gather_along(x: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    """Every rank's `x` (the same shape everywhere) concatenated along `dim` in rank order: one
    all_gather_into_tensor."""
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((size * front.shape[0], *front.shape[1:]))
    _communicate("all-gather", group, front.numel(), lambda: _all_gather_raw(out, front, group))
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """x (size, *block) on every member -> (*block): the sum over the members of x[this member's group rank]."""
    flat = x.contiguous().view(-1)
    out = x.new_empty(x.shape[1:])
    run = _collective("reduce_scatter_single", "reduce_scatter_tensor")
    _communicate("reduce-scatter", group, flat.numel(), lambda: run(out.view(-1), flat, group=group))
    return out


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    _communicate("all-reduce", group, x.numel(), lambda: dist.all_reduce(x, group=group))
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
        return _all_gather_along(x, dim, group, size)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.size, dim=ctx.dim)[ctx.rank].contiguous(), None, None, None, None


def gather_keep_local_grad(x: torch.Tensor, dim: int, group, size: int, rank: int) -> torch.Tensor:
    if size == 1:
        return x
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
    return shares_of(_SumKeepLocalGrad.apply(x, group))


class _GatherOverGroup(torch.autograd.Function):
    """Every member's `x` stacked in rank order: (size, *x.shape). Each member uses all of them differently (a
    ring's halos and state transfers), so backward sums the gradient over the group and keeps this member's block —
    one reduce-scatter (half an all-reduce's traffic, which would hand every member every block); ordered (module
    docstring): a member that uses none of them still joins it."""

    @staticmethod
    def forward(ctx, x, group, size, token):
        ctx.group = group
        remember_order(ctx, token)
        return needs_grad(ctx, _all_gather_along(x.unsqueeze(0), 0, group, size)), new_token(x)

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
    gradient of the rows it sent. Ordered (module docstring): its backward runs on every rank, also where the rows
    received are used by nothing."""

    @staticmethod
    def forward(ctx, x, send_counts, recv_counts, group, token):
        ctx.counts, ctx.group = (send_counts, recv_counts), group
        remember_order(ctx, token)
        return needs_grad(ctx, _exchange_rows(x, send_counts, recv_counts, group)), new_token(x)

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
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    width = math.prod(x.shape[1:])
    _communicate("uneven all-to-all (rows)", group, width,
                 lambda: dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=group))
    return out


def exchange_rows(x: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
    """See `_ExchangeRows`; `x` holds sum(send_counts) rows grouped by destination rank."""
    return ordered(_ExchangeRows, x, send_counts, recv_counts, group)


def group_timeout(group):
    """The timeout the group was created with (None where the backend does not say)."""
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except Exception:  # noqa: BLE001 - a private API, and a group without that device's backend
            continue
    return None


@dataclass
class PendingPass:
    """A ring pass in flight (`start_pass`): `wait()` returns the tensors received, once. The sent tensors are held
    until then (a send buffer must outlive its request)."""

    received: list[torch.Tensor]
    requests: list
    sent: list[torch.Tensor]
    group: object
    timeout: object

    def wait(self) -> list[torch.Tensor]:
        def run():
            for request in self.requests:
                request.wait() if self.timeout is None else request.wait(self.timeout)

        if self.requests:
            _raising("ring pass", self.group, run)
        self.requests, self.sent = [], []
        return self.received


# Whether a ring pass runs behind the compute that follows it (True: `start_pass` returns at once, the caller waits
# after computing) or completes before it (False: the pass waits where it starts — the schedule before the overlap,
# kept for benchmarks/ring_overlap.py to compare). The same collectives in the same order either way.
OVERLAP = True


def start_pass(tensors: list[torch.Tensor], group, next_rank: int, prev_rank: int, tag: int = 0,
               timeout=None) -> PendingPass:
    """Post the sends of `tensors` to `next_rank` and the receives of the same shapes from `prev_rank` (global ranks
    of `group`, a ring) in one batch, and return at once: one communication of the rank's sequence (recorded and
    ordered as issued here), its completion awaited by `PendingPass.wait`. `tag` keeps two rings on the same ranks
    apart (the keys and their gradients in backward); `timeout` bounds the wait (None: the backend's own). No
    autograd: the ring's functions call it in forward and backward. With `OVERLAP` off the pass is complete when this
    returns."""
    received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
    sent = [t.contiguous() for t in tensors]
    ops = [dist.P2POp(dist.isend, t, next_rank, group=group, tag=tag) for t in sent]
    ops += [dist.P2POp(dist.irecv, r, prev_rank, group=group, tag=tag) for r in received]
    requests = _communicate("ring pass", group, sum(t.numel() for t in tensors), lambda: dist.batch_isend_irecv(ops))
    pending = PendingPass(received, requests, sent, group, timeout)
    if not OVERLAP:
        pending.wait()
    return pending


def all_gather_small(values: torch.Tensor, group, size: int) -> torch.Tensor:
    """Gather a small 1-D tensor from every rank of the group (no autograd): shape (size, n)."""
    return _all_gather_along(values, 0, group, size).view(size, -1)
