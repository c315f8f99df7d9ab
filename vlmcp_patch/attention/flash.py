"""flash-attn's own entry points under CP, for scripts that call them directly.

A script may replace a text attention's `forward` by a function of its own that calls flash-attn itself — the
official Qwen3-VL fine-tuning script does in its packed mode (`--data_flatten True`): its forward takes the
sample boundaries from the 1D cumulative lengths the decoder hands it as `attention_mask` and calls
`flash_attn_varlen_func`. Under CP such a forward holds this rank's slice of the row for all heads, and a kernel
called on it would attend within the slice only. So, when flash-attn is importable, its public entry points
(`flash_attn_varlen_func` and `flash_attn_func`, in `flash_attn` and in `flash_attn.flash_attn_interface`) are
replaced at import by wrappers — a script that binds them after `import vlmcp_patch` gets the wrappers:

* outside a CP decoder forward (and inside the package's own attention path, which calls the kernel on the whole
  sequence already) a wrapper is the original function: identical calls, identical results;
* inside a CP decoder forward (`foreign.attention_context`), with q, k, v of this rank's slice (local tokens,
  all heads): the Ulysses exchange to the whole row for H/P heads, the real varlen kernel with the row's sample
  boundaries (the CP padding tail a segment of its own), and the exchange back.

Which boundaries a script's `cu_seqlens` describe is read from their total: the whole row's (the official script
hands the caller's cumulative lengths through) or this slice's. Either must agree with the row the package laid
out; the kernel then runs with the row's. `flash_attn_func` (batch, seq, heads, dim) runs as the varlen kernel
over the samples of the row, which is what it computes for the caller's rows. Anything else the call asks for
that cannot be split (a KV cache block table, attention probabilities) raises on every rank.
"""

from __future__ import annotations

import functools
import inspect

import torch

from ..collectives.communication import all_gather_small
from ..collectives.differentiable import all_to_all
from ..collectives.order import run_ordered
from ..collectives.record import site
from ..context import CPContext
from ..errors import UnsupportedSetupError
from ..patching import Patch, resolve
from .foreign import attention_context, kernel_on_whole_sequence, record_exchange
from .heads import kv_replication
from .ring import ring_attention, ring_shares
from .ring_flash import FLASH_KERNEL

ENTRY_MODULES = ("flash_attn", "flash_attn.flash_attn_interface")


def call_arguments(wrapped, args, kwargs) -> dict:
    return dict(inspect.signature(wrapped).bind(*args, **kwargs).arguments)

THD = 0, 1  # varlen q/k/v: (tokens, heads, dim)


def _boundary_problem(given: torch.Tensor, ctx: CPContext, name: str) -> str | None:
    """What is wrong with the script's cumulative lengths against the row — neither its whole row's nor this slice's
    — or None."""
    row = torch.tensor([0] + [b for _, b in ctx.segments], dtype=given.dtype, device=given.device)
    if int(given[-1]) == ctx.seq_len:
        agrees = torch.equal(given, row)
    elif not ctx.contiguous:  # this rank's tokens are not one run of the row: only the row's boundaries mean anything
        agrees = False
    else:
        start = int(ctx.local_positions[0])
        clipped = (row.clamp(start, start + ctx.local_real_len) - start).unique_consecutive()
        agrees = torch.equal(given[given <= ctx.local_real_len].unique_consecutive(), clipped)
    if agrees:
        return None
    return (f"{name}={given.tolist()}: neither the row's sample boundaries {row.tolist()} nor this rank's slice of "
            "them; the script's boundaries must describe the batch it gave")


def check_boundaries_on_every_rank(problems: list[str | None], ctx: CPContext, device) -> None:
    """Raise `UnsupportedSetupError` on every rank of the CP group when any rank's script gave boundaries that do not
    describe the row (`problems`: this rank's, None where fine). The boundaries reach the package only inside the
    decoder, after the forward's agreement, so the ranks agree on them here: one small all-gather per call, issued on
    every rank whatever its slice holds, before the call's first exchange."""
    mine = [p for p in problems if p is not None]
    failed = [0] if mine else []
    if ctx.cp.size > 1:
        verdicts = all_gather_small(torch.tensor([float(bool(mine))], device=device), ctx.cp.group, ctx.cp.size)
        failed = [rank for rank, bad in enumerate(verdicts[:, 0].tolist()) if bad]
    if failed:
        raise UnsupportedSetupError(
            "flash-attn called under CP with sample boundaries that do not describe the row on CP rank(s) "
            f"{failed}" + (f"; on this rank {'; '.join(mine)}" if mine else "")
        )


def _heads_over_whole_row(q, k, v, ctx: CPContext):
    """q, k, v (local tokens, heads, dim) -> (the subgroup's share of the row, heads / U, dim), KV heads replicated
    where fewer."""
    ulysses = ctx.groups.ulysses
    repeat = kv_replication(q.shape[1], k.shape[1], ulysses.size, what="flash-attn call")
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    return tuple(all_to_all(t, THD[1], THD[0], ulysses.group, ulysses.size) for t in (q, k, v))


def _around_the_ring(q, k, v, ctx: CPContext, options: dict) -> torch.Tensor:
    """The subgroup's share of the row attending over the whole row around the ring (`ring.py`): (T, H/U, D) each."""
    unsupported = [name for name in ("window_size", "softcap", "alibi_slopes", "dropout_p")
                   if options.get(name) not in (None, 0, 0.0, (-1, -1))]
    if not options.get("causal") or unsupported:
        raise UnsupportedSetupError(f"flash-attn across a CP ring (P beyond the heads) runs causal attention only, "
                                    f"without {', '.join(unsupported) or 'causal=False'}")
    scale = options.get("softmax_scale") or q.shape[-1] ** -0.5
    heads_first = [t.transpose(0, 1)[None] for t in (q, k, v)]
    return ring_attention(*heads_first, ring_shares(ctx), ctx.groups.ring, scale,
                          kernel=FLASH_KERNEL)[0].transpose(0, 1)


def _varlen_over_row(varlen, q, k, v, ctx: CPContext, options: dict) -> torch.Tensor:
    """The real varlen kernel on this rank's slice (local tokens, heads, dim) of the row: output in the same layout.
    Across a ring (P beyond the heads) the ring runs instead, flash-attn's kernel on each block."""
    if options.get("block_table") is not None or options.get("return_attn_probs"):
        raise UnsupportedSetupError("flash-attn under CP: a KV-cache block table or return_attn_probs=True cannot be "
                                    "split over the sequence; call it inside `with vlmcp_patch.disabled():`")
    ulysses = ctx.groups.ulysses
    if options.get("alibi_slopes") is not None:  # per head: this rank's heads
        options["alibi_slopes"] = options["alibi_slopes"].chunk(ulysses.size, dim=-1)[ulysses.rank]
    q, k, v = _heads_over_whole_row(q, k, v, ctx)
    with kernel_on_whole_sequence():
        if ctx.contiguous:
            cu, longest = ctx.cu_seqlens(q.device), ctx.max_segment_len
            out = varlen(q, k, v, cu, cu, longest, longest, **options)
        else:
            out = _around_the_ring(q, k, v, ctx, options)
    record_exchange(ctx)
    return all_to_all(out, THD[0], THD[1], ulysses.group, ulysses.size)


def cp_flash_attn_varlen_func(wrapped, instance, args, kwargs):
    ctx = attention_context()
    if ctx is None:
        return wrapped(*args, **kwargs)
    call = call_arguments(wrapped, args, kwargs)
    q, k, v = call.pop("q"), call.pop("k"), call.pop("v")
    problems = [_boundary_problem(call.pop(name), ctx, name) for name in ("cu_seqlens_q", "cu_seqlens_k")]
    with site("a script's flash_attn_varlen_func"):
        check_boundaries_on_every_rank(problems, ctx, q.device)
    for name in ("max_seqlen_q", "max_seqlen_k"):
        call.pop(name, None)
    with site("a script's flash_attn_varlen_func"):
        return run_ordered(_varlen_over_row, wrapped, q, k, v, ctx, call)


def flash_attn_func_over_row(varlen):
    """The wrapper of a module's `flash_attn_func`, running `varlen` (the same module's original varlen kernel) over
    the samples of the row under CP."""

    def wrapper(wrapped, instance, args, kwargs):
        ctx = attention_context()
        if ctx is None:
            return wrapped(*args, **kwargs)
        call = call_arguments(wrapped, args, kwargs)
        q, k, v = call.pop("q"), call.pop("k"), call.pop("v")  # (1, local tokens, heads, dim)
        if q.shape[0] != 1:
            raise UnsupportedSetupError(f"flash_attn_func under CP got {q.shape[0]} rows; the CP decoder runs one")
        with site("a script's flash_attn_func"):
            return run_ordered(_varlen_over_row, varlen, q[0], k[0], v[0], ctx, call)[None]

    return wrapper


def patches() -> list[Patch]:
    out = []
    for module in ENTRY_MODULES:
        varlen = f"{module}.flash_attn_varlen_func"
        out.append(Patch(
            target=varlen,
            wrapper=cp_flash_attn_varlen_func,
            reason="under CP: a script's own flash-attn call on this rank's slice runs the Ulysses exchange around "
            "the real kernel with the row's sample boundaries",
            expects=("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"),
            requires="flash_attn",
        ))
        out.append(Patch(
            target=f"{module}.flash_attn_func",
            wrapper=_dense_wrapper(varlen),
            reason="under CP: a script's own flash_attn_func call on this rank's slice runs as the varlen kernel over "
            "the row's samples, with the Ulysses exchange around it",
            expects=("q", "k", "v"),
            requires="flash_attn",
        ))
    return out


def _dense_wrapper(varlen_target: str):
    """`flash_attn_func_over_row` with the original varlen kernel of the same module."""

    def wrapper(wrapped, instance, args, kwargs):
        return flash_attn_func_over_row(_original(varlen_target))(wrapped, instance, args, kwargs)

    return wrapper


@functools.cache
def _original(target: str):
    _, _, current = resolve(target)
    return getattr(current, "vlmcp_original", current)
