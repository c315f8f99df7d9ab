"""Vision under CP: each rank encodes its share of the images and video frames, and each merged or deepstack
feature goes to the rank whose slice holds its placeholder token.

The multimodal model's `get_image_features` (through which `get_video_features` goes too) is patched. Inside a
CP forward it returns the features of the placeholder tokens of this rank's slice only, in their order — what
stock's placement (`get_placeholder_mask`, `masked_scatter`, the deepstack rows) then consumes on the slice of
ids and embeddings the backbone was given (`slicing.cut_to_slice`). Three steps:

1. **share** — which merged tokens each rank encodes: the plan's `layout.VisionShare` of the modality
   (`plan.py`), decided from `grid_thw` alone before anything runs (every rank decides the same without
   communicating):
   * **by items** (`encode_items`), when they balance: whole images and videos, or the temporal patch groups
     of an item larger than one rank's fair share (the tower attends within each group, so they encode
     independently), in contiguous runs — rank 0 the first units, rank 1 the next, ... — as evenly as contiguous
     runs allow (`layout.contiguous_ranks`); each rank runs the stock tower on its units (patch embedding, blocks,
     merger, deepstack mergers), over tiles of whole temporal groups recomputed in backward when the shares are
     large (`vision_tiles.py`: only the features kept between forward and backward);
   * **by patches** (`encode_patch_slices`), when items cannot balance (fewer images than ranks, one image
     larger than a rank's share): the patches of all items are cut into P equal contiguous slices (whole merged
     tokens each) and every vision attention exchanges sequence for heads (the Ulysses exchange of the decoder,
     non-causal, within each image's attention segments), so even a single large image scales with P;
   * with vision data parallelism off (`VLMCP_VISION_DP=0`), every rank encodes every item.
2. **pixels** (`pixel_share`) — either way a rank's share is one contiguous range of pixel rows (by items, the
   integrations may have cut the pixel values down to it on the host: `host_pixels.py`, `share_rows_in`). A view
   when the pixels already have the tower's device and dtype (the caller keeps them alive anyway, so a copy
   would only add memory: the patch embedding saves its input for backward), and a copy of that range only when
   they come from the host (`placement.py`) or need a cast. A tower in tiles gets the range where the caller has
   it, and each tile moves its own rows when it runs, in forward and in its recompute (`encode_in_tiles`): the
   device never holds the whole share's pixels.
3. **route** (`route_to_owners`) — one all-to-all with uneven splits sends each merged token's features (merged
   and every deepstack level side by side) to the rank that holds its placeholder token. Its backward is the
   reverse exchange: each rank back-propagates the complete gradient of the features it encoded, and the vision
   parameters' gradients summed over the group equal P=1.

A rank with nothing to encode still joins every collective: it runs the tower on a one-merged-token placeholder
(the model's dtype; gradient exactly zero) so that data-parallel wrappers that gather or reduce the tower's
weights see the same module calls on every rank. No rank holds a feature of a token outside its slice.
"""

from __future__ import annotations

import contextvars
import sys

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..collectives.differentiable import exchange_rows
from ..collectives.record import site
from ..context import CTX_KWARG, CPContext, current_cp_forward
from ..distributed import CPGroup
from ..flags import ENCODING_VIDEO, VISION_PLACEHOLDERS, scoped
from ..layout import BY_ITEMS, EVERY_ITEM, VisionShare, round_up, segments_from_lengths, shard_slice
from ..offload import park_features, parks_features
from ..sharding import zero3_leaf
from ..stats import STATS
from ..supported import family_of
from ..vision_tiles import TILES_KWARG, Tied, encode_in_tiles, tiles_whole_call, tiling_applies, tower_placement
from .arguments import call_arguments

# Keyword arguments that precompute per-patch tables for the whole batch: under CP each rank computes those of
# its own share from its grid instead (they are functions of the grid).
WHOLE_BATCH_TABLES = ("interp_indices", "interp_weights", "position_ids", "cu_seqlens", "max_seqlen")


def placeholder_vision_inputs(vision_config, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Patches and grid of the smallest input a vision tower takes: one merged token of zeros."""
    merge = vision_config.spatial_merge_size
    width = vision_config.in_channels * vision_config.temporal_patch_size * vision_config.patch_size**2
    pixels = torch.zeros(merge * merge, width, device=device, dtype=dtype)
    return pixels, torch.tensor([[1, merge, merge]], device=device)


def _features(out) -> list[torch.Tensor]:
    return [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]


def _joined_features(out) -> torch.Tensor:
    """The merged features and every deepstack level side by side: one tensor, one exchange."""
    return torch.cat(_features(out), dim=-1)


class _TiledOutput:
    """The request `encode_items` hands the tower's call (`TILES_KWARG`): its share in tiles. `joined(out)` returns a
    tile's joined features and remembers what `_split_joined` reads of an output (its class, the merged and deepstack
    widths) to make, after the tiles, an output of empty fields (no view of a tile's tensors: nothing of them kept
    alive)."""

    def __init__(self, one_tile: bool = False):
        self.cls, self.widths, self.deepstack, self.one_tile = None, [], False, one_tile

    def joined(self, out) -> torch.Tensor:
        self.cls, self.widths = type(out), [f.shape[-1] for f in _features(out)]
        self.deepstack = getattr(out, "deepstack_features", None) is not None
        return _joined_features(out)

    def template(self, like: torch.Tensor):
        merged, *levels = [like.new_empty((0, w)) for w in self.widths]
        return self.cls(pooler_output=merged, **({"deepstack_features": levels} if self.deepstack else {}))

    def whole(self, joined: torch.Tensor):
        """The stock output class holding `joined`'s features (a whole call's: `tower_forward`)."""
        merged, *levels = joined.split(self.widths, dim=-1)
        return self.cls(pooler_output=merged, **({"deepstack_features": levels} if self.deepstack else {}))


def pixel_share(pixels: torch.Tensor, rows: slice, placement: dict) -> torch.Tensor:
    """The pixel rows `rows` (patches, width) where and in which dtype the tower computes: a view of the caller's
    pixels when they are there already, else a copy of those rows only (from the host, or cast).

    A view costs nothing: the caller keeps its pixel batch alive anyway. A copy is saved for backward by the patch
    embedding, so it is made only where it buys something (the device, the dtype)."""
    return pixels[rows].to(**placement)


def share_rows_in(pixels: torch.Tensor, share: VisionShare, rank: int) -> slice:
    """The rows of `pixels` (patches, width) that hold rank `rank`'s share by items: its rows of the whole where
    `pixels` are the whole batch's, all of them where they are that share, cut on the host (`host_pixels.py`; the
    forward checked them against its plan before compute)."""
    rows = share.patch_rows(rank)
    whole = sum(patches for _, patches, *_ in share.units)
    return rows if pixels.shape[0] == whole else slice(0, rows.stop - rows.start)


def encode_items(tower, pixels: torch.Tensor, grid: torch.Tensor, share: VisionShare, cp: CPGroup,
                 kwargs: dict) -> tuple[object, torch.Tensor]:
    """(tower output, joined features) of this rank's whole items and temporal groups (module docstring)."""
    placement = tower_placement(tower)
    # the tower in tiles (`vision_tiles.py`) on every rank or on none, whatever its share makes (the switch decides,
    # one tile included): only the features are kept
    tiled = _TiledOutput() if tiling_applies(tower) else None
    if share.mine(cp.rank):
        rows = share_rows_in(pixels, share, cp.rank)
        # in tiles each tile's rows are moved when it runs (`encode_in_tiles`); pixels that need a gradient are
        # moved whole, their gradient then the share's
        in_tiles = tiled is not None and not pixels.requires_grad
        local = pixels[rows] if in_tiles else pixel_share(pixels, rows, placement)
        grid = share.local_grid(cp.rank, placement["device"])
    else:
        # The placeholder's rows are dropped; the empty selection keeps its backward (and the exchange) running on
        # this rank, with a zero gradient.
        local, grid = placeholder_vision_inputs(tower.config, **placement)
    if tiled is not None:  # one call of the tower, its tiles inside (`tower_forward`): it returns the joined features
        joined = tower(local, grid_thw=grid, **kwargs, **{TILES_KWARG: tiled})
        out = tiled.template(joined)
    else:
        out = tower(local, grid_thw=grid, **kwargs)
        joined = _joined_features(out)
    if not share.mine(cp.rank):
        joined = joined[:0]
    STATS.record_vision(share.patches_per_rank(), cp.rank)
    return out, joined


def encodes_patch_slices(model) -> bool:
    """Whether the vision tower of `model` can encode one slice of all items' patches (`encode_patch_slices`): it
    takes the per-patch tables as arguments (`_patch_tables`) — transformers' towers do where their modeling module
    imports `get_vision_interpolation_indices_and_weights` (5.15 on). Older towers compute the tables from
    `grid_thw` inside, for whole items only: their images are shared by items (`VisionShare.decide`)."""
    family = family_of(model)
    module = sys.modules.get(family.module) if family is not None else None
    return hasattr(module, "get_vision_interpolation_indices_and_weights")


def _patch_tables(tower, grid: torch.Tensor, rows: slice) -> dict:
    """What the tower computes from `grid_thw` for every patch (position-embedding interpolation, rotary
    positions), for the patch rows `rows` of all items (rows past the last patch: zeros); computed from the items
    those rows overlap only."""
    vision_utils = sys.modules[type(tower).__module__]
    sizes = grid.prod(-1).tolist()
    ends = torch.tensor(sizes).cumsum(0).tolist()
    first = next((i for i, end in enumerate(ends) if end > rows.start), len(sizes) - 1)
    last = next((i for i, end in enumerate(ends) if end >= rows.stop), len(sizes) - 1)
    offset = ends[first] - sizes[first]
    overlapping = grid[first : last + 1]
    indices, weights = vision_utils.get_vision_interpolation_indices_and_weights(
        overlapping, num_grid_per_side=tower.num_grid_per_side, mode=tower.interpolation_mode,
        align_corners=tower.interpolation_align_corners, spatial_merge_size=tower.config.spatial_merge_size,
    )
    positions = vision_utils.get_vision_position_ids(overlapping, tower.spatial_merge_size)
    start = min(rows.start - offset, indices.shape[0])
    stop = min(rows.stop - offset, indices.shape[0])
    length = rows.stop - rows.start

    def cut(t):
        t = t[start:stop]
        return torch.cat([t, t.new_zeros(length - t.shape[0], *t.shape[1:])]) if t.shape[0] < length else t

    return {"interp_indices": cut(indices), "interp_weights": cut(weights), "position_ids": cut(positions)}


def encode_patch_slices(tower, pixels: torch.Tensor, grid: torch.Tensor, share: VisionShare, cp: CPGroup,
                        kwargs: dict) -> tuple[object, torch.Tensor]:
    """(tower output, joined features of the merged tokens `share.held_by_ranks` gives this rank) of one contiguous
    slice of all items' patches, the tower's attention exchanging sequence for heads within each image's segments
    (module docstring)."""
    unit = tower.spatial_merge_size**2
    frames = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0]).tolist()
    merged = sum(frames) // unit
    padded = round_up(merged, cp.size) * unit  # whole merged tokens on every rank
    lengths = frames + ([padded - sum(frames)] if padded > sum(frames) else [])
    vision_ctx = CPContext(cp=cp, segments=segments_from_lengths(lengths))  # attention within each segment
    local_len = vision_ctx.local_len
    rows = shard_slice(vision_ctx.seq_len, cp.size, cp.rank)
    placement = tower_placement(tower)
    real = pixel_share(pixels, slice(rows.start, min(rows.stop, pixels.shape[0])), placement)
    local = torch.cat([real, real.new_zeros(local_len - real.shape[0], real.shape[1])]) if real.shape[0] < local_len \
        else real
    tables = {k: v.to(placement["device"]) for k, v in _patch_tables(tower, grid, rows).items()}
    cu = torch.tensor([0, local_len], dtype=torch.int32, device=placement["device"])  # one local segment: the
    # exchange restores the global ones. Where the tower runs through the recomputed function (its switch, or one
    # order across replicas), the whole slice is its one tile: the slice's attention spans the ranks' slices
    request = {TILES_KWARG: _TiledOutput(one_tile=True)} if tiling_applies(tower) else {}
    out = tower(local, grid_thw=grid.to(placement["device"]), cu_seqlens=cu, max_seqlen=local_len,
                **tables, **kwargs, **{CTX_KWARG: vision_ctx}, **request)
    STATS.record_vision([min(local_len, max(0, sum(frames) - r * local_len)) for r in range(cp.size)], cp.rank)
    if request:
        joined, out = out, request[TILES_KWARG].template(out)
    else:
        joined = _joined_features(out)
    return out, joined[: share.held_by_ranks[cp.rank].numel()]


def route_to_owners(local: torch.Tensor, held: list[torch.Tensor], owner: torch.Tensor, cp: CPGroup) -> torch.Tensor:
    """The features (rows of `local`, one per merged token rank `cp.rank` encoded, in `held[cp.rank]` order) sent
    to the ranks whose slices hold their tokens: returns the rows of this rank's tokens, in token order.

    `held[r]`: the merged tokens rank r encoded (every token exactly once over the ranks); `owner[k]`: the rank
    whose slice holds token k, -1 for a token on padding (not in the row: its feature goes to no rank, its rows of
    `local` get a zero gradient, as stock's feature placed on padding does)."""
    destination = owner[held[cp.rank]]
    sent = (destination >= 0).nonzero().flatten()
    send_order = sent[torch.argsort(destination[sent], stable=True)]
    send_counts = torch.bincount(destination[sent], minlength=cp.size).tolist()
    arriving = [tokens[owner[tokens] == cp.rank] for tokens in held]  # from each rank, in its send order
    received = exchange_rows(local.index_select(0, send_order.to(local.device)), send_counts,
                             [t.numel() for t in arriving], cp.group)
    return received.index_select(0, torch.argsort(torch.cat(arriving)).to(received.device))


def encode_every_item(tower, pixels: torch.Tensor, grid: torch.Tensor, owner: torch.Tensor, cp: CPGroup,
                      kwargs: dict) -> tuple[object, torch.Tensor]:
    """(tower output, joined features of this rank's tokens) with vision data parallelism off: every rank encodes
    every item and keeps the features of its own tokens (no exchange)."""
    placement = tower_placement(tower)
    out = tower(pixels.to(**placement), grid_thw=grid.to(placement["device"]), **kwargs)
    mine = (owner == cp.rank).nonzero().flatten()
    joined = _joined_features(out)
    return out, joined.index_select(0, mine.to(joined.device))


def features_of_slice(tower, pixels: torch.Tensor, grid: torch.Tensor, tokens: torch.Tensor, share: VisionShare,
                      ctx: CPContext, kwargs: dict) -> tuple[object, torch.Tensor]:
    """(tower output, joined features of the placeholder tokens in this rank's slice, in order). `tokens`: the row
    positions of this modality's placeholder tokens; `share`: how the ranks share its vision work (the plan's)."""
    cp, owner = ctx.cp, ctx.owner_of(tokens)
    if share.method == EVERY_ITEM:
        return encode_every_item(tower, pixels, grid, owner, cp, kwargs)
    encode = encode_items if share.method == BY_ITEMS else encode_patch_slices
    out, local = encode(tower, pixels, grid, share, cp, kwargs)
    return out, route_to_owners(local, share.held_by_ranks, owner, cp)


def _split_joined(out, joined: torch.Tensor, deepstack_per_item: bool):
    """The tower's output class holding `joined`'s columns as one item: the merged features and each deepstack
    level (each level a one-item tuple where the installed release splits them per item). Where the features wait on
    the host (`offload.parks_features`) they are host copies (`offload.park_features`), else views of `joined`."""
    widths = [f.shape[-1] for f in _features(out)]
    merged, *levels = park_features(joined, widths) if parks_features() else joined.split(widths, dim=-1)
    fields = {"pooler_output": (merged,)}
    if getattr(out, "deepstack_features", None) is not None:
        fields["deepstack_features"] = [(level,) if deepstack_per_item else level for level in levels]
    return type(out)(**fields)


def cp_image_features(wrapped, instance, args, kwargs, deepstack_per_item: bool = False):
    """A multimodal model's `get_image_features` (a wrapper in wrapt's convention). Inside a CP forward (P > 1, real
    pixels, not a placeholder pass) it returns the features of this rank's placeholder tokens as one item (module
    docstring); `deepstack_per_item`: the installed release's forward expects the deepstack levels split per item.
    Everywhere else, the stock method."""
    ctx = current_cp_forward()
    modality = "video" if ENCODING_VIDEO.get() else "image"
    if ctx is None or ctx.cp.size == 1 or modality in VISION_PLACEHOLDERS.get():
        return wrapped(*args, **kwargs)
    call = call_arguments(wrapped, args, kwargs)
    pixels, grid = call.pop("pixel_values"), call.pop("image_grid_thw")
    return_dict = call.pop("return_dict", True)
    for name in WHOLE_BATCH_TABLES:
        call.pop(name, None)
    with site(f"the {modality} features' route to their tokens' ranks"):
        out, joined = features_of_slice(instance.visual, pixels, grid, ctx.vision_tokens[modality],
                                        ctx.vision_shares[modality], ctx, call)
    out = _split_joined(out, joined, deepstack_per_item)
    levels = getattr(out, "deepstack_features", None)
    if levels is not None:
        ctx.deepstack_levels[modality] = [level[0] if isinstance(level, tuple) else level for level in levels]
    return out if return_dict else out.to_tuple()


def use_the_routed_deepstack_levels(levels: list, ctx: CPContext) -> None:
    """Give the decoder the deepstack levels this path returned, in place of stock's copies (in `levels`, the list
    the decoder reads). Stock's forward copies each level (`torch.cat` per item, transformers 5.18+) and keeps the
    levels it was handed alive to its end: the features then live twice through the decoder's forward, where a long
    video row's peak is. With one modality the copies hold the same values as the returned levels (a cat of one
    tensor), and once the list holds the levels themselves the copies go. Anything else is left as it is: images
    and videos together (stock joins their levels into new tensors), or a list that does not match the levels. The
    context lets go of the levels here: it lives on in the backward graph, and they would keep the features there."""
    recorded = list(ctx.deepstack_levels.values())
    ctx.deepstack_levels.clear()
    if len(recorded) != 1 or not isinstance(levels, list) or not levels:
        return
    (routed,) = recorded
    if len(routed) != len(levels) or all(theirs is ours for theirs, ours in zip(levels, routed)):
        return
    for theirs, ours in zip(levels, routed):
        if not (isinstance(theirs, torch.Tensor) and theirs.shape == ours.shape and theirs.dtype == ours.dtype
                and theirs.device == ours.device and torch.equal(theirs, ours)):
            return
    levels[:] = routed


class _Anchored:
    """A ZeRO-3 leaf tower's call in progress (`tower_call`): the tower; whether torch's hooks see its output (the
    first call of the tower in a forward: `visible`); the anchor as the hooks passed it to the forward (`hooked`); how
    the forward flattened a stock output (a pytree spec, for `tower_call` to rebuild it; None: not flattened)."""

    def __init__(self, tower, visible: bool):
        self.tower, self.visible, self.hooked, self.spec, self.whole = tower, visible, None, None, None


# The anchored call in progress (`tower_call`), read by the tower's forward (`tower_forward`).
_ANCHORED: contextvars.ContextVar = contextvars.ContextVar("vlmcp_anchored_tower", default=None)


def tower_call(wrapped, instance, args, kwargs):
    """A vision tower's `__call__` (wrapt's convention). A ZeRO-3 leaf tower (`sharding.zero3_leaf`: under CP
    with vision tiling on) called with gradients gets one more positional argument, an empty tensor that requires a
    gradient: its anchor. Everything else: the stock call.

    ZeRO-3 reduces a leaf's gradients in the leaf's full backward hook, once per call, and its reductions assume one
    per parameter and backward. torch runs that hook when the gradients of the call's inputs are computed — with no
    input requiring one, as soon as the output's arrives (before the weights' gradients exist) — and only for a call
    whose output holds tensors it can see (a tensor or a tuple of them, not a ModelOutput). So the first call of the
    tower in a CP forward is seen: its output a tensor (tiles) or the tuple of its output's leaves (rebuilt here,
    outside the hooks), its anchor's gradient made to come after every weight's (`tower_forward`). Each later call
    (images, then videos) is not: its output stays out of torch's sight, and its anchor derives from the first call's
    anchor as that call's hooks passed it on, so the first call's hook — the one reduction — waits for every call's
    backward."""
    if not (torch.is_grad_enabled() and zero3_leaf(instance)
            and any(p.requires_grad for p in instance.parameters())):
        return wrapped(*args, **kwargs)
    ctx = current_cp_forward()
    anchors = ctx.tower_anchors if ctx is not None else {}
    first = anchors.get(id(instance))
    if first is None:
        anchor = torch.empty(0, device=next(instance.parameters()).device, requires_grad=True)
    else:
        anchor = first.clone()  # its gradient joins the first call's anchor's
    call = _Anchored(instance, visible=first is None)
    with scoped(_ANCHORED, call):
        result = wrapped(*args, anchor, **kwargs)
    if first is None:
        anchors[id(instance)] = call.hooked
    if call.spec is not None:
        return tree_unflatten(list(result), call.spec)
    if call.whole is not None:  # a whole call in tiles: its joined features, as the stock output class
        return call.whole.whole(result if call.visible else result[0])
    return result if call.visible or not isinstance(result, list) else result[0]


def tower_forward(wrapped, instance, args, kwargs):
    """A vision tower's `forward` (wrapt's convention): `(hidden_states (patches, width), grid_thw, ...)`.

    With `TILES_KWARG` (a `_TiledOutput`, from `encode_items`): the share's joined features (merged tokens,
    features), computed in tiles inside this one call (`vision_tiles.encode_in_tiles`), each tile through the
    unhooked stock forward. Without it, with the tower's tiles on and a call that asks for its features alone
    (`vision_tiles.tiles_whole_call`: CP off, at P=1 only as set; under CP every item on every rank, a placeholder
    pass): the call's own items the same way, returned as the stock output class with the features whole (merged and
    deepstack; `last_hidden_state` None). Inside an anchored call (`tower_call`): the anchor is fed into the tiles,
    or tied to the pixels of the stock forward; the output of a call torch's hooks should see is one tensor in tiles
    (a whole call's joined features too, rebuilt as the stock output by `tower_call`: ZeRO-3 gathers a leaf once per
    output tensor in backward, so every tiled call of every replica shows one) or a tuple untiled (the stock output's
    leaves), of one they should not a list or the stock output. Otherwise the stock forward."""
    request = kwargs.pop(TILES_KWARG, None)
    call, anchor = _ANCHORED.get(), None
    if call is not None and call.tower is instance:
        *args, anchor = args
        call.hooked = anchor
    whole = request is None and tiles_whole_call(instance, kwargs, (*WHOLE_BATCH_TABLES, CTX_KWARG))
    with scoped(_ANCHORED, None):  # the calls inside are no anchored calls
        if whole:
            request = _TiledOutput()
        if request is not None:
            named = call_arguments(wrapped, args, kwargs)
            pixels, grid = named.pop("hidden_states"), named.pop("grid_thw")

            def encode(rows: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
                return request.joined(wrapped(rows, grid_thw=grid_thw, **named))

            joined = encode_in_tiles(instance, pixels, grid.tolist(), encode, anchor, one_tile=request.one_tile)
            if anchor is not None:
                # torch's hooks see one tensor, whatever the call: the leaf's gathers in backward (one per output
                # tensor) then match across replicas whose calls differ (a placeholder beside a share by items)
                if whole:
                    call.whole = request
                return [joined] if not call.visible else joined
            if not whole:
                return joined
            out = request.whole(joined)
        elif anchor is None:
            return wrapped(*args, **kwargs)
        else:
            if args:
                args = (Tied.apply(args[0], anchor), *args[1:])
            else:
                kwargs["hidden_states"] = Tied.apply(kwargs["hidden_states"], anchor)
            out = wrapped(*args, **kwargs)
    if anchor is None or not call.visible:
        return out
    leaves, call.spec = tree_flatten(out)
    return tuple(leaves)


def cp_video_features(wrapped, instance, args, kwargs):
    """`get_video_features` hands the videos to `get_image_features`: mark them as videos on the way."""
    with scoped(ENCODING_VIDEO, True):
        return wrapped(*args, **kwargs)
