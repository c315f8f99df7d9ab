"""The vision tower in tiles of items under CP (`vlmcp_patch/vision_tiles.py`), run inside the spawned ranks: rows
whose vision share by items holds several temporal groups per rank, tiles small enough that every rank runs
several, against stock at P=1."""

from __future__ import annotations

from tests.helpers.cases import FAMILIES, masked_where_stock_cuts, stock_cuts_this_row
from vlmcp_patch.fixtures.data import Segment as S
from vlmcp_patch.fixtures.data import make_batch
from vlmcp_patch.fixtures.models import build_model

# A video of four temporal patch groups (8 frames, 4 x 4 patches each) beside two images: at P=2 the video is split
# into its groups (larger than a rank's fair share) and each rank holds three units; at P=4 one or two.
VIDEO_GROUPS = [[S(text=5), S(video=(8, 16, 16)), S(text=4), S(image=(16, 24)), S(text=3), S(image=(16, 16)),
                 S(text=2)]]
# Two videos of four groups each, each a rank's fair share at P=2: whole units of four groups, which the tiles split.
TWO_VIDEOS = [[S(text=3), S(video=(8, 16, 16)), S(text=4), S(video=(8, 16, 16)), S(text=2)]]

# A video of four small groups beside a one-group video as large: at P=2 rank 0 encodes the first (four tiles of a
# group), rank 1 the second (one tile, which it runs through the tiles too: the group takes one path).
UNEVEN_VIDEOS = [[S(text=3), S(video=(4, 16, 16)), S(text=4), S(video=(1, 32, 32)), S(text=2)]]

# Per CP size, (family, gradient checkpointing, layout, patches per tile): 1 is a tile per temporal group (or image).
CASES = {
    2: [("qwen3_vl", False, VIDEO_GROUPS, 1), ("qwen3_vl", True, VIDEO_GROUPS, 32),
        ("qwen3_5", "reentrant", TWO_VIDEOS, 20), ("qwen3_vl", True, UNEVEN_VIDEOS, 16)],
    4: [("qwen3_vl", True, VIDEO_GROUPS, 1), ("qwen3_5", False, VIDEO_GROUPS, 1)],
}


def _model_and_batch(family: str, checkpointing, layout):
    make_config = FAMILIES[family][0]
    model = build_model(make_config(), seed=1)
    if checkpointing:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
        model.train()
    return model, make_batch(layout, seed=7)


def _count_accumulations(model) -> dict:
    """Times each vision parameter's gradient was accumulated (the event DDP, ZeRO and FSDP2 hook)."""
    counts = {name: 0 for name, p in model.named_parameters() if p.requires_grad and ".visual." in f".{name}"}
    for name, p in model.named_parameters():
        if name in counts:
            p.register_post_accumulate_grad_hook(lambda _, name=name: counts.__setitem__(name, counts[name] + 1))
    return counts


def run_vision_tile_cases(rank: int, world_size: int) -> dict:
    """Parity metrics (`parity.compare`) of each case of `CASES[world_size]` with its `vision_tile_patches`, the
    tower tiles this rank ran, and how often each vision parameter's gradient was accumulated (stock's backward and
    CP's)."""
    import vlmcp_patch
    from tests.helpers.parity import compare
    from vlmcp_patch.vision_tiles import VISION_TILES

    results = {}
    try:
        for family, checkpointing, layout, tile in CASES[world_size]:
            vlmcp_patch.enable(vision_tile_patches=tile)
            model, batch = _model_and_batch(family, checkpointing, layout)
            counts = _count_accumulations(model)
            VISION_TILES.drain()
            metrics = compare(model, batch, world_size)
            metrics["tiles"] = VISION_TILES.drain()
            metrics["accumulations"] = sorted(set(counts.values()))
            metrics["stock_cut"] = stock_cuts_this_row(batch, checkpointing)
            results[f"{family} checkpointing={checkpointing} tile={tile}"] = metrics
    finally:
        vlmcp_patch.enable(vision_tile_patches="auto")
    return results


def run_every_item_in_tiles(rank: int, world_size: int) -> dict:
    """With vision data parallelism off (every rank encodes every item) and tiles of 16 patches: parity metrics
    (`parity.compare`), and the tower tiles this rank ran."""
    import vlmcp_patch
    from tests.helpers.parity import compare
    from vlmcp_patch.vision_tiles import VISION_TILES

    vlmcp_patch.enable(vision_tile_patches=16, vision_dp=False)
    try:
        model, batch = _model_and_batch("qwen3_vl", True, VIDEO_GROUPS)
        batch = masked_where_stock_cuts(batch, True)
        VISION_TILES.drain()
        metrics = compare(model, batch, world_size)
        metrics["tiles"] = VISION_TILES.drain()
    finally:
        vlmcp_patch.enable(vision_tile_patches="auto", vision_dp=True)
    return metrics


def run_pixel_moves(rank: int, world_size: int) -> dict:
    """Per vision tile setting (0: untiled, 32 patches), the rows of each move of the caller's pixels to the tower's
    device and dtype that this rank's CP step made, forward and backward. The pixels are given in float64 and the
    tower computes in float32, so every move copies, as one from the host to a GPU does (the integrations leave the
    pixels on the host under CP). Also the step's loss, the same whatever the tiles."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import vlmcp_patch

    class Moves(TorchDispatchMode):
        rows: list

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if (func is torch.ops.aten._to_copy.default and args[0].dtype == torch.float64
                    and kwargs.get("device") is not None):  # a move to the tower, not the batch's fingerprint
                self.rows.append(args[0].shape[0])
            return func(*args, **kwargs)

    results = {}
    try:
        for tile in (0, 32):
            vlmcp_patch.enable(cp_size=world_size, vision_tile_patches=tile)
            model, batch = _model_and_batch("qwen3_vl", True, VIDEO_GROUPS)
            batch = {**batch, "pixel_values_videos": batch["pixel_values_videos"].double()}
            moves = Moves()
            moves.rows = []
            with moves:
                loss = model(**batch).loss
                loss.backward()
            results[tile] = {"rows": moves.rows, "loss": loss.item()}
    finally:
        vlmcp_patch.enable(cp_size=1, vision_tile_patches="auto")
    return results
