"""One recomputation in tiles, for all that runs piece by piece under CP: the MLPs and RMSNorms over tiles of tokens
(`tiles.py`), the vision tower over tiles of items (`vision_tiles.py`).

Forward runs a function tile by tile and keeps nothing of a tile but its rows of the output (and the inputs, saved
for backward). Backward recomputes each tile with gradients, as its forward ran (the same autocast state, the same
memory switches — the choice of the forward that ran it, `switches.py`, not a later forward's; where the caller asks,
the same random state), back-propagates the tile's rows of the output's gradient, and lets the tile's intermediates go
before the next one: one tile's working set is alive at a time.

Gradients: an input's rows get their tile's gradient (each row belongs to one tile: exact). A parameter's gradient
is summed over the tiles inside the function, in fp32 (fp64 parameters in fp64), and cast once to the parameter's
dtype, then returned once, as the gradient of that input: autograd accumulates it into `.grad` once per backward, so
the hooks of DDP, ZeRO and FSDP2 (which fire when a parameter's gradient is accumulated) see one gradient, as without
tiles. With bf16 parameters a sum in bf16 would round at every tile, its error growing with the number of tiles; in
fp32 the tiled gradient is as near the exact one as the untiled (`tests/test_mlp_tiles.py` measures it). The fp32
sums are transient: one per parameter the function reads, for the length of its backward.

One tile covering everything runs the function once and recomputes it once, returning its own output and gradients
untouched (no copy, no cast). Its callers take this function whenever their switch is on, one tile included, so that
when a parameter's gradient arrives depends on the switch alone, never on the row's length: replicas whose gradients
are reduced in arrival order (ZeRO-1/2 buckets) agree on the switches (`by_need`), and so on that order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .stats import TileCounts
from .switches import forward_choice, replayed_choice

Span = tuple[int, int]  # rows [a, b)


@dataclass(frozen=True)
class TiledWork:
    """The work `RecomputedTiles` runs.

    `fn(k, *pieces)`: tile k's rows of the output from its rows of the tiled inputs (reading the parameters passed
    beside them); `spans[k]`: tile k's (input rows, output rows), in order, the output rows covering the output;
    `counts`: the telemetry it reports to; `device`: where fn computes (its autocast state, and random state, are
    replayed there); `place`: moves a tile's rows of a tiled input to where fn reads them, when the tile runs
    (forward and recompute; None: they are there); `scope`: a context around every tile's compute (forward and
    recompute); `replay_rng`: recompute each tile from the random state its forward started from (a function drawing
    random numbers, e.g. dropout)."""

    fn: Callable[..., torch.Tensor]
    spans: Sequence[tuple[Span, Span]]
    counts: TileCounts
    device: torch.device
    place: Callable[[torch.Tensor], torch.Tensor] | None = None
    scope: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    replay_rng: bool = False


def autocast_of(device: torch.device) -> dict:
    """The autocast state of `device`'s type now, to recompute a tile in backward as its forward ran."""
    kind = device.type
    return {"device_type": kind, "enabled": torch.is_autocast_enabled(kind), "dtype": torch.get_autocast_dtype(kind)}


def _rng_state(device: torch.device) -> tuple:
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


@contextlib.contextmanager
def _replayed_rng(state: tuple | None, device: torch.device):
    """The random state `state` while the block runs (None: the current one); the caller's state untouched after."""
    if state is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class RecomputedTiles(torch.autograd.Function):
    """`work.fn` over `work.spans`, recomputed tile by tile in backward (module docstring).

    Inputs: `work` (`TiledWork`), `num_tiled`, `anchor` (None, or an empty tensor that requires a gradient: its
    gradient, empty, is returned with the parameters' — a ZeRO-3 leaf's hook waits for it, `vision_tiles`), then the
    `tiled` tensors (rows on dim 0; integer ones get no gradient) and the parameters fn reads. Output: (output rows,
    ...), as fn's pieces. Saves the tiled inputs only."""

    @staticmethod
    def forward(ctx, work: TiledWork, num_tiled: int, anchor: torch.Tensor | None, *inputs):
        tiled = inputs[:num_tiled]
        ctx.work, ctx.params = work, inputs[num_tiled:]
        ctx.anchor = None if anchor is None else (anchor.shape, anchor.dtype, anchor.device)
        ctx.autocast = autocast_of(work.device)
        ctx.choice = forward_choice()  # the switches fn runs under, replayed in backward (module docstring)
        ctx.save_for_backward(*tiled)
        ctx.rng = []
        out = None
        for k, ((a, b), (c, d)) in enumerate(work.spans):
            ctx.rng.append(_rng_state(work.device) if work.replay_rng else None)
            with work.scope():
                piece = work.fn(k, *_placed(work, [t[a:b] for t in tiled]))
            if len(work.spans) == 1:  # the whole at once: fn's own output, no copy
                out = piece
                break
            if out is None:
                out = piece.new_empty((work.spans[-1][1][1], *piece.shape[1:]))
            out[c:d] = piece
            del piece  # the tile's intermediates go before the next tile runs
        work.counts.forward_tiles += len(work.spans)
        work.counts.calls += 1
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        work, tiled, params = ctx.work, ctx.saved_tensors, ctx.params
        wants = ctx.needs_input_grad[3:]
        whole = len(work.spans) == 1
        tiled_grads = [None if whole or not want else torch.zeros_like(t) for t, want in zip(tiled, wants)]
        sums: list[torch.Tensor | None] = [None] * len(params)
        for k, ((a, b), (c, d)) in enumerate(work.spans):
            pieces = [t[a:b].detach().requires_grad_(want) for t, want in zip(tiled, wants)]
            with torch.enable_grad(), torch.autocast(**ctx.autocast), replayed_choice(ctx.choice), work.scope(), \
                    _replayed_rng(ctx.rng[k], work.device):
                out = work.fn(k, *_placed(work, pieces))
            sources = [(i, x) for i, (x, want) in enumerate(zip([*pieces, *params], wants)) if want]
            grads = torch.autograd.grad(out, [x for _, x in sources], grad_out[c:d], allow_unused=True)
            del out, pieces  # the tile's recomputed intermediates go before the next tile's
            for (i, _), grad in zip(sources, grads):
                if grad is None:
                    continue
                if i < len(tiled):
                    if whole:
                        tiled_grads[i] = grad
                    else:
                        tiled_grads[i][a:b] = grad
                elif whole:
                    sums[i - len(tiled)] = grad
                elif sums[i - len(tiled)] is None:
                    sums[i - len(tiled)] = grad.to(_accumulation_dtype(grad.dtype), copy=True)
                else:
                    sums[i - len(tiled)].add_(grad)
            work.counts.backward_tiles += 1
        param_grads = [None if s is None else s.to(p.dtype) for s, p in zip(sums, params)]
        anchor_grad = None
        if ctx.anchor is not None and ctx.needs_input_grad[2]:
            shape, dtype, device = ctx.anchor
            anchor_grad = torch.zeros(shape, dtype=dtype, device=device)
        return None, None, anchor_grad, *tiled_grads, *param_grads


def _placed(work: TiledWork, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
    return pieces if work.place is None else [work.place(p) for p in pieces]


def recompute_in_tiles(work: TiledWork, tiled: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
                       anchor: torch.Tensor | None = None) -> torch.Tensor:
    """`work` over its tiles (`RecomputedTiles`): `tiled` (rows on dim 0) split by `work.spans`, `params` the
    parameters `work.fn` reads (their gradients summed over the tiles in fp32), `anchor` a ZeRO-3 leaf's
    (`vision_tiles`). Output: the rows of every tile's output at its output span."""
    return RecomputedTiles.apply(work, len(tiled), anchor, *tiled, *params)
