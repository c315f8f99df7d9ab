"""The MLPs in sequence tiles under CP: never the whole slice's intermediates at once.

An MLP is token-wise: each output row depends on its own input row only (the dense MLPs; the MoE experts given each
token's routing). So it can run over tiles of the rank's tokens, one after the other, and produce exactly the rows
the whole slice would. `tokenwise_tiles` does that in forward without keeping any tile's intermediates (the
activations of `intermediate_size` per token, 4-12x the hidden states, are the largest tensors of a recomputed
layer), and in backward recomputes each tile and back-propagates it before the next one.

The recomputation is the package's one tiled recompute (`tiled_recompute.py`, shared with the vision tower): each
parameter's gradient is summed over the tiles inside the function, in fp32, cast once to the parameter's dtype and
returned once, as the gradient of that input: autograd then accumulates it into `.grad` once per backward, so the
hooks of DDP, ZeRO-2/3 and FSDP2 (which fire when a parameter's gradient is accumulated) see one gradient, as with the
untiled MLP, and in bf16 it is as near the exact gradient as the untiled MLP's.

An MLP whose weights a sharding wrapper gathers piece by piece inside its call — ZeRO-3 hooks on its Linear children,
or FSDP2 units at or inside it (a size-based wrapping policy) — runs untiled (`sharding.gathers_per_submodule_call`):
each tile would start its own gathers, and ranks whose tiles differ in number would issue different collectives.
Under the package's DeepSpeed integration the decoder's MLPs are ZeRO-3 leaves (`gather_whole_mlps_under_zero3`); an
MLP inside an FSDP2 unit (a decoder layer's, the usual policy) is gathered whole with it and tiles.

Tile size (`mlp_tile_tokens`): `VLMCP_MLP_TILE_TOKENS` when set; else equal tiles whose intermediates take at most the
memory of the slice's hidden states (`INTERMEDIATE_PER_HIDDEN`), of at most `hidden_size` tokens (DeepSpeed ALST's
TiledMLP shards a sequence the same way: a long slice's tile then holds a fixed few hundred MB, not a share of the
slice), and of at least `MIN_TILE` tokens — a shorter tile would read every weight for a few rows. A slice of one
tile still runs through the tiled function, as one tile (its output and gradients the stock ones, untouched): when the
MLP's weight gradients arrive in backward then depends on the switch alone, never on the row's length, so replicas
whose switches agree (`by_need`) deliver their gradients in one order (ZeRO-1/2 fill their buckets in that order).

When: as set (`VLMCP_MLP_TILE_TOKENS=N` or `on`, at any P), or under CP when the row needs it (`switches.py`,
chosen by `by_need.py`); with CP off and nothing set every MLP runs stock. Not while torch.compile traces (the compiled
graph keeps the stock MLP).

The decoder's RMSNorms take the same path (`recomputed_norm_forward`): transformers' norms compute in fp32, and
autograd keeps an fp32 copy of the input and the normalized input (in bf16 also its cast back) — three times the
input's bytes in bf16, per norm, for the whole layer's backward. Run through `tokenwise_tiles`, a norm keeps its input
only and is recomputed in backward, in tiles of rows, so that its fp32 intermediates and their gradients (about six
fp32 values per number) are one tile's. Each row runs the stock ops, so values and input gradients are the stock
ones; the weight's gradient is summed over the tiles. `VLMCP_RECOMPUTE_NORMS=0` turns it off, `1` turns it on at any P; by need under CP otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from .forward.arguments import call_arguments
from .settings import AUTO, SETTINGS
from .stats import TileCounts
from .sharding import gathers_per_submodule_call, make_zero3_leaf
from .tiled_recompute import TiledWork, recompute_in_tiles

MIN_TILE = 1024  # tokens: the matmuls of a tile stay large enough to run at full speed
INTERMEDIATE_PER_HIDDEN = 1  # a tile's intermediates take at most this many times the slice's hidden states


def tile_tokens(num_tokens: int, hidden_size: int, intermediate_width: int, configured: int | str = AUTO,
                longest: int | None = None) -> int:
    """Tokens (rows) per tile over `num_tokens` (module docstring); `intermediate_width`: the numbers one token holds
    in the intermediates; `configured`: `SETTINGS.mlp_tile_tokens` (0: one tile of everything); `longest`: with the
    automatic rule, no tile holds more tokens than this (at least `MIN_TILE`)."""
    if num_tokens == 0:  # an empty slice: one empty tile
        return 1
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
    """The tiles [a, b) of `size` tokens over `num_tokens`: at least one (an empty slice makes one empty tile)."""
    return [(a, min(a + size, num_tokens)) for a in range(0, max(num_tokens, 1), size)]


TILES = TileCounts()
NORMS = TileCounts(facts_key="cp_norm_tiles_per_call")  # telemetry of `recomputed_norm_forward`
# An RMSNorm's backward holds about this many fp32 values per normalized number at once (the input's fp32 copy, the
# normalized input, their gradients): its tiles are sized like an MLP's with this intermediate width
NORM_BACKWARD_WIDTH = 6


def tokenwise_tiles(fn: Callable, bounds: Sequence[tuple[int, int]], counts: TileCounts,
                    tiled: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> torch.Tensor:
    """`fn(*tiled)` computed tile by tile: the rows `a:b` of the output are `fn(*(t[a:b] for t in tiled))`.

    `fn`: token-wise, reads `params`; `bounds`: the tiles (`tile_bounds`; one tile: the whole, run once and recomputed
    in backward); `counts`: the `TileCounts` it reports to; `tiled`: tokens on dim 0, same length (integer ones get no
    gradient). Output: (tokens, ...), as fn's. Keeps the tiled inputs only; backward recomputes tile by tile and
    returns each parameter's gradient summed over the tiles in fp32, cast once (`tiled_recompute.RecomputedTiles`)."""
    work = TiledWork(fn=lambda _, *pieces: fn(*pieces), spans=[(span, span) for span in bounds], counts=counts,
                     device=tiled[0].device)
    return recompute_in_tiles(work, tiled, params)


def tiling_applies() -> bool:
    """Whether the MLPs run in tiles now: set (`VLMCP_MLP_TILE_TOKENS`, at any P) or chosen by need under CP
    (`by_need.py`), not while torch.compile traces."""
    from .switches import mlp_tiles_on

    return not torch.compiler.is_compiling() and mlp_tiles_on()


def run_in_tiles(fn: Callable, tiled: Sequence[torch.Tensor], module: torch.nn.Module, hidden_size: int,
                 intermediate_width: int) -> torch.Tensor | None:
    """`fn(*tiled)` over tiles of the tokens (dim 0 of every `tiled` tensor), fn reading `module`'s parameters; one
    tile when the tokens make one (module docstring: the switch alone decides the path, not the row). None when a
    sharding wrapper gathers the module piece by piece (the caller then runs its stock forward)."""
    from .switches import size_setting  # "on" sizes like "auto"

    if gathers_per_submodule_call(module):
        return None
    tokens = tiled[0].shape[0]
    size = mlp_tile_tokens(tokens, hidden_size, intermediate_width, size_setting(SETTINGS.mlp_tile_tokens))
    params = [p for p in module.parameters() if p.requires_grad]
    return tokenwise_tiles(fn, tile_bounds(tokens, size), TILES, tiled, params)


# The dense MLP classes the families tile (`models/base.mlp_patches`): their forward calls child Linear modules. Those
# of the decoder (called once per forward) become ZeRO-3 leaves under CP (`gather_whole_mlps_under_zero3`); the vision
# blocks' MLPs do not (`VISION_MLP_CLASSES`).
DENSE_MLP_CLASSES: set[str] = set()
VISION_MLP_CLASSES: set[str] = set()


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
            make_zero3_leaf(module)


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
    from .switches import norms_recompute_on

    return torch.is_grad_enabled() and not torch.compiler.is_compiling() and norms_recompute_on()


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
    out = tokenwise_tiles(wrapped, tile_bounds(rows.shape[0], size), NORMS, [rows], params)
    return out.reshape(*x.shape[:-1], out.shape[-1])
