"""The MLPs in sequence tiles under CP: never the whole slice's intermediates at once.

An MLP is token-wise: each output row depends on its own input row only (the dense MLPs; the MoE experts given each
token's routing). So it can run over tiles of the rank's tokens, one after the other, and produce exactly the rows
the whole slice would. `TokenwiseTiles` does that in forward without keeping any tile's intermediates (the
activations of `intermediate_size` per token, 4-12x the hidden states, are the largest tensors of a recomputed
layer), and in backward recomputes each tile and back-propagates it before the next one.

Each parameter's gradient is accumulated over the tiles inside the function and returned once, as the gradient of
that input: autograd then accumulates it into `.grad` once per backward, so the hooks of DDP, ZeRO-2/3 and FSDP2
(which fire when a parameter's gradient is accumulated) see one gradient, as with the untiled MLP.

Tile size (`mlp_tile_tokens`): `VLMCP_MLP_TILE_TOKENS` when set; else equal tiles whose intermediates take at most the
memory of the slice's hidden states (`INTERMEDIATE_PER_HIDDEN`), of at most `hidden_size` tokens (DeepSpeed ALST's
TiledMLP shards a sequence the same way: a long slice's tile then holds a fixed few hundred MB, not a share of the
slice), and of at least `MIN_TILE` tokens — a shorter tile would read every weight for a few rows. A slice of one
tile runs the stock forward, untouched.

Only under CP (`cp_size() > 1`): with CP off every MLP runs stock. Not while torch.compile traces (the compiled graph
keeps the stock MLP).

The decoder's RMSNorms take the same path (`recomputed_norm_forward`): transformers' norms compute in fp32, and
autograd keeps an fp32 copy of the input and the normalized input (in bf16 also its cast back) — three times the
input's bytes in bf16, per norm, for the whole layer's backward. Run through `TokenwiseTiles`, a norm keeps its input
only and is recomputed in backward, in tiles of rows, so that its fp32 intermediates and their gradients (about six
fp32 values per number) are one tile's. Each row runs the stock ops, so values and input gradients are the stock
ones; the weight's gradient is summed over the tiles. `VLMCP_RECOMPUTE_NORMS=0` turns it off; CP off never does it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from .forward.arguments import call_arguments
from .patching import cp_size
from .settings import AUTO, SETTINGS
from .stats import TileCounts
from .vision_tiles import autocast_of, zero3_partitioned

MIN_TILE = 1024  # tokens: the matmuls of a tile stay large enough to run at full speed
INTERMEDIATE_PER_HIDDEN = 1  # a tile's intermediates take at most this many times the slice's hidden states


def tile_tokens(num_tokens: int, hidden_size: int, intermediate_width: int, configured: int | str = AUTO,
                longest: int | None = None) -> int:
    """Tokens (rows) per tile over `num_tokens` (module docstring); `intermediate_width`: the numbers one token holds
    in the intermediates; `configured`: `SETTINGS.mlp_tile_tokens` (0: one tile of everything); `longest`: with the
    automatic rule, no tile holds more tokens than this (at least `MIN_TILE`)."""
    if configured != AUTO:
        return configured or num_tokens
    proportional = math.ceil(num_tokens / max(1, intermediate_width // (hidden_size * INTERMEDIATE_PER_HIDDEN)))
    wanted = math.ceil(num_tokens / proportional)
    if longest is not None:
        wanted = max(wanted, math.ceil(num_tokens / max(longest, MIN_TILE)))
    count = max(1, min(wanted, num_tokens // MIN_TILE))
    return math.ceil(num_tokens / count)


def mlp_tile_tokens(num_tokens: int, hidden_size: int, intermediate_width: int,
                    configured: int | str = AUTO) -> int:
    """Tokens per tile of an MLP of `hidden_size` over `num_tokens` tokens (module docstring): `tile_tokens` with
    tiles of at most `hidden_size` tokens. The plan prices the same rule (`planning.memory.mlp_share`)."""
    return tile_tokens(num_tokens, hidden_size, intermediate_width, configured, longest=hidden_size)


def tile_bounds(num_tokens: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(a + size, num_tokens)) for a in range(0, num_tokens, size)]


TILES = TileCounts()
NORMS = TileCounts(facts_key="cp_norm_tiles_per_call")  # telemetry of `recomputed_norm_forward`
# An RMSNorm's backward holds about this many fp32 values per normalized number at once (the input's fp32 copy, the
# normalized input, their gradients): its tiles are sized like an MLP's with this intermediate width
NORM_BACKWARD_WIDTH = 6


class TokenwiseTiles(torch.autograd.Function):
    """`fn(*tiled)` computed tile by tile: the rows `a:b` of the output are `fn(*(t[a:b] for t in tiled))`.

    Inputs: `fn` (token-wise; reads `params`), `bounds` (the tiles, `tile_bounds`; one tile: the whole, run once and
    recomputed in backward), `counts` (the `TileCounts` it reports to), `num_tiled`, then the `tiled` tensors (tokens
    on dim 0, same length; integer ones get no gradient) and the `params` fn reads. Output: (tokens, ...), as fn's.
    Saves the tiled inputs only; backward recomputes tile by tile and returns each parameter's gradient summed over
    the tiles (module docstring)."""

    @staticmethod
    def forward(ctx, fn: Callable, bounds: Sequence[tuple[int, int]], counts: TileCounts, num_tiled: int, *inputs):
        tiled = inputs[:num_tiled]
        ctx.fn, ctx.bounds, ctx.counts, ctx.params = fn, bounds, counts, inputs[num_tiled:]
        ctx.autocast = autocast_of(tiled[0].device)
        ctx.save_for_backward(*tiled)
        if len(bounds) == 1:  # the whole at once: fn's own output, no copy
            out = fn(*tiled)
        else:
            out = None
            for a, b in bounds:
                piece = fn(*(t[a:b] for t in tiled))
                if out is None:
                    out = piece.new_empty((bounds[-1][1], *piece.shape[1:]))
                out[a:b] = piece
        counts.forward_tiles += len(bounds)
        counts.calls += 1
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        tiled, params = ctx.saved_tensors, ctx.params
        wants = ctx.needs_input_grad[4:]
        whole = len(ctx.bounds) == 1
        tiled_grads = [None if whole or not want else torch.zeros_like(t) for t, want in zip(tiled, wants)]
        param_grads: list[torch.Tensor | None] = [None] * len(params)
        for a, b in ctx.bounds:
            pieces = [t[a:b].detach().requires_grad_(want) for t, want in zip(tiled, wants)]
            with torch.enable_grad(), torch.autocast(**ctx.autocast):
                out = ctx.fn(*pieces)
            sources = [(i, x) for i, (x, want) in enumerate(zip([*pieces, *params], wants)) if want]
            grads = torch.autograd.grad(out, [x for _, x in sources], grad_out[a:b], allow_unused=True)
            del out, pieces  # the tile's recomputed intermediates go before the next tile's
            for (i, _), grad in zip(sources, grads):
                if grad is None:
                    continue
                if i < len(tiled):
                    if whole:
                        tiled_grads[i] = grad
                    else:
                        tiled_grads[i][a:b] = grad
                elif param_grads[i - len(tiled)] is None:
                    param_grads[i - len(tiled)] = grad
                else:
                    param_grads[i - len(tiled)] += grad
            ctx.counts.backward_tiles += 1
        return None, None, None, None, *tiled_grads, *param_grads


def tiling_applies() -> bool:
    """Whether the MLPs run in tiles now: set (`VLMCP_MLP_TILE_TOKENS`, at any P) or chosen by need under CP
    (`by_need.py`), not while torch.compile traces."""
    from .by_need import mlp_tiles_on

    return mlp_tiles_on() and not torch.compiler.is_compiling()


def run_in_tiles(fn: Callable, tiled: Sequence[torch.Tensor], module: torch.nn.Module, hidden_size: int,
                 intermediate_width: int) -> torch.Tensor | None:
    """`fn(*tiled)` over tiles of the tokens (dim 0 of every `tiled` tensor), fn reading `module`'s parameters; None
    when the tokens make one tile (the caller then runs its stock forward)."""
    from .by_need import size_setting  # "on" sizes like "auto"

    tokens = tiled[0].shape[0]
    size = mlp_tile_tokens(tokens, hidden_size, intermediate_width, size_setting(SETTINGS.mlp_tile_tokens))
    if size >= tokens or _zero3_gathers_per_child_call(module):
        return None
    params = [p for p in module.parameters() if p.requires_grad]
    return TokenwiseTiles.apply(fn, tile_bounds(tokens, size), TILES, len(tiled), *tiled, *params)


# The dense MLP classes the families tile (`models/base.mlp_patches`): their forward calls child Linear modules. Those
# of the decoder (called once per forward) become ZeRO-3 leaves under CP (`gather_whole_mlps_under_zero3`); the vision
# blocks' MLPs do not (`VISION_MLP_CLASSES`).
DENSE_MLP_CLASSES: set[str] = set()
VISION_MLP_CLASSES: set[str] = set()


def _zero3_gathers_per_child_call(module: torch.nn.Module) -> bool:
    """Whether ZeRO-3 gathers `module`'s weights child by child, at each child's call: tiles would then start one
    gather per tile, and ranks with different numbers of tiles would issue different collectives. Such a module runs
    untiled (`gather_whole_mlps_under_zero3` prevents it under the package's DeepSpeed integration). Not when the
    module is a ZeRO-3 leaf, or inside one (its weights then carry their leaf, `ds_z3_leaf_module`: a vision MLP in a
    leaf tower, `vision_tiles.gather_whole_towers_under_zero3`)."""
    params = list(module.parameters())
    children_hooked = any(next(child.parameters(), None) is not None for child in module.children())
    in_a_leaf = bool(params) and all(getattr(p, "ds_z3_leaf_module", None) is not None for p in params)
    return zero3_partitioned(module) and children_hooked and not (getattr(module, "_z3_leaf", False) or in_a_leaf)


def gather_whole_mlps_under_zero3(model: torch.nn.Module | None) -> None:
    """Before `deepspeed.initialize` under CP: every dense MLP of the decoder the families tile becomes a ZeRO-3 leaf
    module — its weights gathered once per call by its own hooks, its Linear children without hooks of their own — so
    its tiles start no gathers (the MoE experts hold their weights themselves: nothing to do). With tiling off,
    nothing.

    Not the vision blocks' MLPs: the tower runs once per modality in a forward (images, then videos), and ZeRO-3
    reduces a leaf's gradients once per call while its reductions assume one per parameter and backward (two calls
    failed its bucket check, or would overwrite the first call's gradient). They tile inside a vision tower made a
    leaf (`vision_tiles.gather_whole_towers_under_zero3`, whose calls reduce once per forward), and run untiled in a
    tower ZeRO-3 gathers module by module."""
    if model is None or SETTINGS.mlp_tile_tokens == 0:
        return
    for module in model.modules():
        names = {cls.__name__ for cls in type(module).__mro__}
        if names & DENSE_MLP_CLASSES and not names & VISION_MLP_CLASSES:
            module._z3_leaf = True  # deepspeed.utils.set_z3_leaf_module, read when ZeRO-3 registers its hooks


def _single_input(args: tuple, kwargs: dict) -> torch.Tensor:
    (x,) = (*args, *kwargs.values())
    return x


def _intermediate_size(module: torch.nn.Module, hidden_size: int) -> int:
    return getattr(module, "intermediate_size", None) or getattr(module, "intermediate_dim", None) or 4 * hidden_size


def tiled_mlp(intermediates: int) -> Callable:
    """The wrapper (wrapt's convention) of a dense MLP's forward `(x) -> y`, token-wise over the last dim of x:
    under CP (`tiling_applies`) the tokens run in tiles; `intermediates`: how many tensors of `intermediate_size`
    per token its forward holds (a gated MLP: gate, up, activation, product)."""

    def forward(wrapped, instance, args, kwargs):
        if not tiling_applies():
            return wrapped(*args, **kwargs)
        x = _single_input(args, kwargs)
        hidden = x.shape[-1]
        width = intermediates * _intermediate_size(instance, hidden)
        out = run_in_tiles(wrapped, [x.reshape(-1, hidden)], instance, hidden, width)
        return wrapped(*args, **kwargs) if out is None else out.reshape(*x.shape[:-1], out.shape[-1])

    return forward


def tiled_experts_forward(wrapped, instance, args, kwargs):
    """The wrapper of a MoE experts module's forward `(hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k))
    -> (T, H)`, token-wise given each token's routing: under CP its tokens run in tiles. The router stays whole (its
    outputs are k numbers per token); expert parallelism (an exchange inside the experts) is left untiled."""
    if not tiling_applies() or getattr(instance, "_is_expert_parallel", False):
        return wrapped(*args, **kwargs)
    call = call_arguments(wrapped, args, kwargs)
    hidden, index, weights = call["hidden_states"], call["top_k_index"], call["top_k_weights"]
    width = 4 * index.shape[-1] * _intermediate_size(instance, hidden.shape[-1])
    out = run_in_tiles(wrapped, [hidden, index, weights], instance, hidden.shape[-1], width)
    return wrapped(*args, **kwargs) if out is None else out


def norms_recompute_applies() -> bool:
    """Whether the RMSNorms run as recomputed tiles now: set (`VLMCP_RECOMPUTE_NORMS=1`, at any P) or chosen by
    need under CP (`by_need.py`), a graph being recorded, not while torch.compile traces."""
    from .by_need import norms_recompute_on

    return norms_recompute_on() and torch.is_grad_enabled() and not torch.compiler.is_compiling()


def recomputed_norm_forward(wrapped, instance, args, kwargs):
    """The wrapper of an RMSNorm's forward `(hidden_states) -> y`, row-wise over the last dim: under CP
    (`norms_recompute_applies`) it keeps only its input for backward and is recomputed there, in tiles of rows
    (module docstring)."""
    if not norms_recompute_applies():
        return wrapped(*args, **kwargs)
    x = _single_input(args, kwargs)
    params = [p for p in instance.parameters() if p.requires_grad]
    if not params and not x.requires_grad:
        return wrapped(*args, **kwargs)
    rows = x.reshape(-1, x.shape[-1])  # q and k norms normalize each head: a row per token and head
    size = tile_tokens(rows.shape[0], rows.shape[1], NORM_BACKWARD_WIDTH * rows.shape[1])
    out = TokenwiseTiles.apply(wrapped, tile_bounds(rows.shape[0], size), NORMS, 1, rows, *params)
    return out.reshape(*x.shape[:-1], out.shape[-1])
