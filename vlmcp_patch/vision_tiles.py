"""The vision tower over tiles of items: never the whole share's tower activations at once.

The tower's blocks never mix items: attention runs within one image or one temporal patch group (`cu_seqlens`), and
everything else is per patch or per merged token. So a rank's share by items (`forward/vision.encode_items`) can run
through the whole tower — patch embedding, blocks, merger, deepstack mergers — one tile of whole temporal patch
groups after the other, and produce exactly the features the whole share would. `vision_in_tiles` does that in forward
without keeping anything of a tile but its joined features (merged and deepstack, side by side: `out_hidden x (1 +
levels)` per merged token; Qwen3-VL-8B: 4,096 numbers per patch, against 31,104 for its 27 blocks' checkpoints), and in
backward recomputes each tile with gradients and back-propagates its rows of the features' gradient before the next
one. A tile is the recomputation unit: the blocks' own gradient checkpointing (and its host offload) is off inside
a tile's forward and recompute, so each block is computed twice, as with checkpointing, and one tile's activations
are alive at a time.

The whole tiled pass runs inside one call of the tower module: `encode_items` calls the tower once with the tiles
(`TILES_KWARG`), and its patched forward (`forward/vision.tower_forward`) runs this function, whose `encode` calls
the tower's unhooked forward per tile. The recomputation is the package's one tiled recompute (`tiled_recompute.py`,
shared with the MLPs and norms; the tower's specifics are its arguments: each tile's pixel rows moved when it runs,
checkpointing off inside a tile, the random state replayed, the anchor). Each parameter's gradient is summed over the
tiles inside the function, in fp32, cast once to the parameter's dtype, and returned once, as the gradient of that
input: autograd accumulates it into `.grad` once per backward (per tower call), as the untiled tower does, so the
hooks of DDP and ZeRO-2 see one gradient, and in bf16 it is as near the exact gradient as the untiled tower's.

ZeRO-3: under CP with tiling on the DeepSpeed integration makes the tower a ZeRO-3 leaf module before the engine
registers its hooks (`gather_whole_towers_under_zero3`): its weights are gathered whole once per tower call, in
forward and again in backward (when the features' gradient reaches the call's output), and its children get no
hooks — a rank's tiles start no gathers, whatever their number. DeepSpeed reduces a leaf's gradients in the leaf's
full backward hook, once per call, assuming one reduction per parameter and backward; torch fires that hook when the
gradients of the call's inputs are computed — with no input requiring one (pixels do not), as soon as the output's
gradient arrives, before the weights' gradients exist — and only for a call whose output it can see. So every
gradient-enabled call of a leaf tower gets an anchor (`forward/vision.tower_call`): an empty positional input that
requires a gradient, fed into this function (or, untiled, tied to the pixels: the patch embedding then computes the
pixels' gradient too, a transient the size of the call's pixels), whose gradient comes with or after every weight's;
and of the tower's calls in one CP forward (images, videos) only the first is seen by torch's hooks, the later ones'
anchors deriving from its anchor, so one reduction runs, after every call's backward. (A DeepSpeed that reduced a
leaf's parameters at their accumulation instead would see one summed gradient per parameter as well.) The plan
counts the gathered tower beside a tile's recompute (`planning.memory`).

A tower whose parameters ZeRO-3 gathers module by module (not a leaf: tiling was off at `deepspeed.initialize`) or
that holds FSDP2 units (the newest Accelerate's policy wraps its blocks) runs untiled
(`sharding.gathers_per_submodule_call`): their gathers would follow each rank's own number of tiles (different
collectives on different ranks). A tower inside one FSDP2 unit (Accelerate 1.11 wraps it with the root) is gathered
whole with that unit, and tiles.

A switch that is on always takes the tiled function (`tiling_applies`), even for one tile: every rank of a CP group runs
its share through it, in one tile if that is all it makes (a rank with nothing to encode: its placeholder as one
tile), and so does every data replica. The vision parameters' gradients then arrive in an order set by the switch
alone, never by a rank's row — ZeRO-2 packs gradients into its buckets in the order they arrive and reduces the
buckets' flat buffers across ranks, so a tiled rank beside an untiled one (all weights' gradients at once against
block by block) would sum different parameters' gradients. One tile is exact as the untiled tower is: the function
runs it once, keeps its features, and recomputes it once in backward (`tiled_recompute.py`).

Tiles (`plan_tiles`): a rank's units split into their temporal patch groups (a video unit of t groups is t
independent groups to the tower), packed in order into tiles of at most `tile_patches` patches (a group larger than
that is a tile of its own); each tile is one contiguous range of the rank's pixel rows with its own `grid_thw` rows
(consecutive groups of one item joined into one row) and one contiguous range of merged tokens.

Tile size (`tile_patches`): `vision_tile_patches` when set; else equal tiles whose activations (every block's, as
a tile's recompute keeps them) take at most the memory of the share's kept features, and hold at least `MIN_TILE`
patches.

RNG: each tile's recompute replays the random state its forward started from (as torch's checkpoint does), so a
tower with dropout recomputes the same masks; the masks themselves are drawn per tile, so differ from an untiled
tower's draw (the released towers have no dropout).

When: as set (`VLMCP_VISION_TILE_PATCHES=N` or `on`, at any P), or under CP when the row needs it (`switches.py`,
chosen by `by_need.py`); not while torch.compile traces. With CP off (P=1, or inside `disabled()`) the switch on (at
P=1: set) tiles every call of the tower that asks for its features alone (`tiles_whole_call`; stock
`get_image_features` and `get_video_features` do): the tower's patched forward (`forward/vision.tower_forward`) runs
the call's own items through this function and returns the stock output class with the features whole —
`last_hidden_state` None (stock's code never reads it; the model output's `image_outputs` / `video_outputs` hand
it on, None there too, and no longer keep the last block's output alive). Unset (`auto`) or `0`, CP off runs the stock tower, bit
for bit. A call that asks for the blocks' hidden states or attentions, a tuple, or passes per-patch tables of the
whole call runs whole. Under CP the same goes for the calls outside the by-items share: a rank encoding every item
(`VLMCP_VISION_DP=0`), a replica's placeholder pass (a share by patches never tiles). ZeRO-3 makes the tower a leaf
under CP only (`gather_whole_towers_under_zero3`, from the DeepSpeed integration): at P=1 it gathers the tower
module by module, which runs untiled (above).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .settings import AUTO, SETTINGS
from .sharding import gathers_per_submodule_call, make_zero3_leaf
from .stats import TileCounts
from .tiled_recompute import TiledWork, recompute_in_tiles

MIN_TILE = 4096  # patches (1,024 merged tokens at merge 2): a tile's matmuls stay large


def vision_work_per_patch(vision_config) -> int:
    """Elements one patch keeps in a tile's recompute: every block's saved activations (norms, qkv, attention, the
    projection's input, the MLP's input, hidden and activation: 13 w + 2 I_v, as `planning.memory.vision_elements`)."""
    w = vision_config.hidden_size
    return vision_config.depth * (13 * w + 2 * vision_config.intermediate_size)


def kept_per_patch(vision_config) -> float:
    """Elements one patch keeps between forward and backward when tiled: its share of its merged token's features."""
    levels = len(getattr(vision_config, "deepstack_visual_indexes", None) or ())
    return vision_config.out_hidden_size * (1 + levels) / vision_config.spatial_merge_size**2


def tile_patches(patches: int, work_per_patch: float, kept: float, configured: int | str = AUTO) -> int:
    """Patches per tile of a share of `patches` patches (module docstring); `work_per_patch`, `kept`: elements per
    patch of a tile's recompute and of the kept features; `configured`: `SETTINGS.vision_tile_patches` (0: one tile
    of everything)."""
    if configured != AUTO:
        return configured or patches
    count = max(1, min(math.ceil(work_per_patch / kept), patches // MIN_TILE))
    return math.ceil(patches / count)


@dataclass(frozen=True)
class Tile:
    """One tile of a rank's share: its pixel rows (relative to the share), its `grid_thw` rows, its merged tokens."""

    rows: tuple[int, int]
    grid: tuple[tuple[int, int, int], ...]
    merged: tuple[int, int]


def plan_tiles(units: Sequence[tuple[int, int, int]], budget: int, merge_unit: int) -> list[Tile]:
    """Tiles of a share whose units are `units` [(frames, height, width)] in pixel-row order: its temporal groups
    packed in order into tiles of at most `budget` patches (a larger group alone)."""
    groups = [(unit, h * w) for unit, (t, h, w) in enumerate(units) for _ in range(t)]
    tiles, start, members = [], 0, []

    def close():
        nonlocal start, members
        patches = sum(p for _, p in members)
        grid = []
        for unit, _ in members:  # consecutive groups of one unit: one grid row of that many frames
            if grid and grid[-1][0] == unit:
                grid[-1][1] += 1
            else:
                grid.append([unit, 1])
        rows = tuple((n, *units[u][1:]) for u, n in grid)
        tiles.append(Tile((start, start + patches), rows, (start // merge_unit, (start + patches) // merge_unit)))
        start, members = start + patches, []

    for group in groups:
        if members and sum(p for _, p in members) + group[1] > budget:
            close()
        members.append(group)
    if members:
        close()
    return tiles


VISION_TILES = TileCounts(facts_key="cp_vision_tiles_per_call")


@contextlib.contextmanager
def without_checkpointing(tower: torch.nn.Module):
    """The tower's modules with their gradient checkpointing off while the block runs: a tile is the recomputation
    unit (module docstring); restored after."""
    switched = [m for m in tower.modules() if getattr(m, "gradient_checkpointing", False)]
    for m in switched:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m in switched:
            m.gradient_checkpointing = True


def vision_in_tiles(encode: Callable[[Tile, torch.Tensor], torch.Tensor], tower: torch.nn.Module,
                    tiles: Sequence[Tile], placement: dict, pixels: torch.Tensor, anchor: torch.Tensor | None,
                    params: Sequence[torch.Tensor]) -> torch.Tensor:
    """`encode(tile, pixels[tile.rows])` for each tile, its rows of the output at `tile.merged`.

    `encode`: the tower on one tile, (patches, width) -> joined features (merged tokens, features), reading `params`;
    `tower`: its checkpointing switched off while a tile runs; `tiles`: `plan_tiles`; `placement`: the tower's device
    and dtype; `pixels`: the share's rows, wherever the caller has them (each tile's rows are moved to `placement` when
    the tile runs, in forward and again in backward); `anchor`: None, or an empty tensor whose gradient — empty — is
    returned with the parameters' (a ZeRO-3 leaf's hook waits for it, module docstring). Output: (the share's merged
    tokens, features). Keeps `pixels` only; backward recomputes tile by tile, replaying each tile's random state, and
    returns each parameter's gradient summed over the tiles in fp32, cast once (`tiled_recompute.RecomputedTiles`)."""
    work = TiledWork(fn=lambda k, rows: encode(tiles[k], rows), spans=[(t.rows, t.merged) for t in tiles],
                     counts=VISION_TILES, device=placement["device"], place=lambda rows: rows.to(**placement),
                     scope=lambda: without_checkpointing(tower), replay_rng=True)
    return recompute_in_tiles(work, [pixels], params, anchor)


def one_order_required(tower: torch.nn.Module) -> bool:
    """Whether every call of `tower` now runs through the recomputed function, one tile where its switch is off: in a
    data-parallel step whose wrapper reduces gradients in their arrival order (`replica_step`: DeepSpeed's ZeRO),
    with gradients, where the vision passes are matched across replicas (under CP, or `VLMCP_MATCH_VISION_PASSES=1`).

    The replicas' calls differ in what they hold — real items beside a placeholder, a share by items beside one by
    patches — and the stock tower's weights' gradients then arrive in orders that follow its outputs' consumers (a
    placeholder's deepstack levels reach the tower before its merged features). Through the recomputed function each
    call delivers every weight's gradient at one node, in the parameters' order, whatever the call holds, so every
    replica fills the wrapper's buckets alike. It costs one more forward of the tower only where its blocks are not
    checkpointed already (a tile is the recomputation unit); where its weights are gathered per submodule it cannot
    run (ZeRO-3 makes the tower a leaf under CP for it: `gather_whole_towers_under_zero3`)."""
    from .distributed import cp_requested, data_parallel_world_size
    from .replica_step import replica_step

    if not torch.is_grad_enabled() or not (cp_requested() or SETTINGS.match_vision_passes is True):
        return False
    if data_parallel_world_size() == 1:
        return False
    step = replica_step(tower)
    return step is not None and step.arrival_order


def tiling_applies(tower: torch.nn.Module) -> bool:
    """Whether the tower runs in tiles now: its switch on (`switches.vision_tiles_on`: as set at any P, chosen by
    need under CP) or one order required (`one_order_required`: one tile), not while torch.compile traces, its
    parameters not gathered per module (module docstring)."""
    from .switches import vision_tiles_on  # set, or chosen by need under CP

    return ((vision_tiles_on() or one_order_required(tower)) and not torch.compiler.is_compiling()
            and not gathers_per_submodule_call(tower))


# What a call of the tower may ask beside its features (merged and deepstack). The tiles return the features only,
# and each tile computes its own per-patch tables, so a call that asks for any of these runs whole: the hidden states
# or attentions of the blocks, or a tuple (whose positions hold the last hidden state).
WHOLE_CALL_FLAGS = ("output_hidden_states", "output_attentions")


def tiles_whole_call(tower: torch.nn.Module, kwargs: dict, tables: Sequence[str]) -> bool:
    """Whether a call of the tower that did not ask for tiles itself (not `encode_items`' request) runs its items in
    tiles: with CP off (P=1, `disabled()`) every stock call, under CP a rank encoding every item
    (`VLMCP_VISION_DP=0`) or a replica's placeholder pass. Tiling applies (`tiling_applies`: at P=1 only where
    `VLMCP_VISION_TILE_PATCHES` is set, `N` or `on`), and the call asks for its features alone, in an output object:
    no hidden states or attentions, no tuple, none of `tables` (keyword names: per-patch tables of the whole call,
    which each tile computes for itself from its grid, or a patch slice's CP context)."""
    config = tower.config
    if any(kwargs.get(flag, getattr(config, flag, False)) for flag in WHOLE_CALL_FLAGS):
        return False
    if kwargs.get("return_dict", getattr(config, "return_dict", True)) is False:
        return False
    return not any(name in kwargs for name in tables) and tiling_applies(tower)


def _tiles_of(config, units: Sequence[tuple[int, int, int]]) -> list[Tile]:
    """The tiles of a share whose units are `units` [(frames, height, width)], by the automatic or configured size;
    one tile where the switch is off (the function runs for one order alone: `one_order_required`)."""
    from .switches import size_setting, vision_tiles_on  # "on" sizes like "auto"

    patches = sum(t * h * w for t, h, w in units)
    budget = tile_patches(patches, vision_work_per_patch(config), kept_per_patch(config),
                          size_setting(SETTINGS.vision_tile_patches)) if vision_tiles_on() else patches
    return plan_tiles(units, budget, config.spatial_merge_size**2)


# The keyword argument with which `forward/vision.encode_items` asks the tower's patched forward for its share's joined
# features in tiles (popped there: the stock forward never sees it).
TILES_KWARG = "vlmcp_vision_tiles"


def encode_in_tiles(tower, pixels: torch.Tensor, units: Sequence[tuple[int, int, int]],
                    encode: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                    anchor: torch.Tensor | None = None, one_tile: bool = False) -> torch.Tensor:
    """The joined features (merged tokens, features) of a share by items — `pixels` (patches, width) its rows,
    `units` [(frames, height, width)] its grid — computed in tiles (one if that is all it makes: `tiling_applies`
    decides for the group); `encode(pixels, grid_thw)` runs the tower's unhooked forward and returns the joined
    features; `anchor`: a ZeRO-3 leaf tower's (`vision_in_tiles`). Called inside the tower's call (module docstring).
    `pixels` may be on the host (the integrations leave them there under CP): each tile's rows go to the tower's
    device and dtype when the tile runs, so the device never holds the whole share's pixels. `one_tile`: every row of
    `pixels` in one tile with the grid `units` (a slice of all items' patches, `forward/vision.encode_patch_slices`,
    which only the whole slice encodes)."""
    if one_tile:
        merged = pixels.shape[0] // tower.config.spatial_merge_size**2
        tiles = [Tile((0, pixels.shape[0]), tuple(tuple(u) for u in units), (0, merged))]
    else:
        tiles = _tiles_of(tower.config, units)
    placement = tower_placement(tower)
    device = placement["device"]

    def encode_tile(tile: Tile, rows: torch.Tensor) -> torch.Tensor:
        return encode(rows, torch.tensor(tile.grid, device=device))

    params = [p for p in tower.parameters() if p.requires_grad]
    return vision_in_tiles(encode_tile, tower, tiles, placement, pixels, anchor, params)


def tower_placement(tower) -> dict:
    """Where and in which dtype the tower computes (its pixels are moved there)."""
    return {"device": next(tower.parameters()).device, "dtype": tower.dtype}


# The vision tower classes of the families (`models/base.py`): made ZeRO-3 leaves under CP.
VISION_TOWER_CLASSES: set[str] = set()


def gather_whole_towers_under_zero3(model: torch.nn.Module | None) -> None:
    """Before `deepspeed.initialize` under CP: every vision tower of the families becomes a ZeRO-3 leaf module — its
    weights gathered whole once per call by its own hooks, its modules without hooks of their own — so its tiles
    start no gathers (module docstring). With vision tiling off too: where the replicas' gradients must arrive in one
    order every call runs through the recomputed function (`one_order_required`), which a tower gathered module by
    module cannot."""
    if model is None:
        return
    for module in model.modules():
        if type(module).__name__ in VISION_TOWER_CLASSES:
            make_zero3_leaf(module)


class Tied(torch.autograd.Function):
    """`x` itself, tied to `anchor` (an empty tensor that requires a gradient): the output requires a gradient even when
    x does not, and the anchor's gradient (empty) comes back with x's, after everything computed from x. An untiled
    call of a ZeRO-3 leaf tower ties its anchor to its pixels this way (module docstring); under CP the frozen input
    embeddings' output reaches the layers this way, as no leaf (`integrations/input_grads.py`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, anchor: torch.Tensor):
        ctx.anchor = (anchor.shape, anchor.dtype, anchor.device)
        return x.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, device = ctx.anchor
        return (grad if ctx.needs_input_grad[0] else None), torch.zeros(shape, dtype=dtype, device=device)
