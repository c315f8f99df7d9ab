"""The vision tower over tiles of items (`vlmcp_patch/vision_tiles.py`): under CP exact against stock at P=1 with
several tiles really run, each vision parameter's gradient accumulated once per tower call; with CP off stock bit for
bit by default and, as set, every tower call in tiles, exact; a switch that is on tiles even one tile; the tiles of a
share and their automatic size."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.cases import MULTI_IMAGE
from tests.helpers.harness import run_distributed
from tests.helpers.parity import TOL, gradient_errors
from tests.helpers.vision_replica_cases import REPLICA_CASES, run_replica_cases
from tests.helpers.vision_tile_cases import (
    CASES,
    TWO_VIDEOS,
    VIDEO_GROUPS,
    _model_and_batch,
    run_every_item_in_tiles,
    run_pixel_moves,
    run_vision_tile_cases,
)
from tests.helpers.zero3_vision_cases import run_zero3_vision_cases
from vlmcp_patch.vision_tiles import Tile, plan_tiles, tile_patches


def vision_tiles_run(cp_size: int):
    return run_distributed(run_vision_tile_cases, cp_size, timeout=600)


@pytest.mark.parametrize("cp_size", sorted(CASES))
def test_tiled_vision_tower_equals_stock(cp_size, once):
    ran, results = 0, once(vision_tiles_run, cp_size)
    for case in results[0]:  # the group takes one path: every rank tiles the same tower calls (ZeRO-2 needs it)
        assert len({per_case[case]["tiles"]["calls"] for per_case in results}) == 1, case
    for rank, per_case in enumerate(results):
        for case, m in per_case.items():
            where = f"{case}, P={cp_size}, rank {rank}"
            if not m["stock_cut"]:  # stock's reference is wrong on this release (tests/helpers/cases.py)
                assert m["loss_err"] <= TOL and m["logits_err"] <= TOL, where
                assert m["grad_err"] <= TOL, f"{where}: {m['worst_grad']}"
            assert m["missing_grads"] == [], where
            tiles = m["tiles"]
            # the training step and the logits' forward: each tiled tower call ran every tile forward, the step's
            # once more in backward
            assert tiles["forward_tiles"] >= tiles["calls"] > 0, (where, tiles)
            assert tiles["backward_tiles"] * 2 <= tiles["forward_tiles"], (where, tiles)
            ran += tiles["backward_tiles"]
            # one accumulation per vision parameter per tower call: stock's (images, videos), then CP's
            assert len(m["accumulations"]) == 1, (where, m["accumulations"])
        assert per_case[next(iter(per_case))]["tiles"]["backward_tiles"] >= 2, (rank, per_case)
    assert ran > 0


def test_every_item_on_every_rank_runs_in_tiles_under_cp():
    """With vision data parallelism off (`VLMCP_VISION_DP=0`) at P=2, each rank's tower call holds every item: with
    tiles set it runs them in tiles (the call as with CP off), and the loss, logits and every gradient summed over
    the group equal stock P=1's within 1e-5. The control: the tiles ran, each in forward and in backward."""
    for rank, m in enumerate(run_distributed(run_every_item_in_tiles, 2, timeout=600)):
        assert m["loss_err"] <= TOL and m["logits_err"] <= TOL, rank
        assert m["grad_err"] <= TOL, (rank, m["worst_grad"])
        tiles = m["tiles"]  # the step's two calls (images, video) tiled, then the logits' forward's
        assert tiles["calls"] == 4 and tiles["backward_tiles"] * 2 <= tiles["forward_tiles"], (rank, tiles)


def test_zero3_tiles_the_tower_inside_one_gathered_call_like_p1():
    """DeepSpeed ZeRO-3 at P=2 (gloo): the tower a ZeRO-3 leaf, gathered whole once per call, its tiles inside that
    call — four on rank 0, one on rank 1: different numbers of tiles, the same collectives — and every parameter's
    full gradient equal to stock's at P=1; the same leaf tower called twice per forward (images, then the video), both
    through the tiled function (the images shared by patches: their slice one tile), and both untiled (by need,
    nothing chosen), each parameter reduced once; with vision tiling off the tower a leaf too (under CP with DeepSpeed
    every call may have to run through the recomputed function, for one gradient order across replicas), called
    twice untiled; with vision data parallelism off, each rank's two calls (every item) in tiles."""
    pytest.importorskip("deepspeed")
    results = run_distributed(run_zero3_vision_cases, 2, timeout=600)
    assert [r["uneven tiles"]["tiles"]["forward_tiles"] for r in results] == [4, 1]
    for rank, per_case in enumerate(results):
        for case, m in per_case.items():
            where = f"{case}, rank {rank}"
            assert m["leaf"], where
            assert abs(m["loss"] - m["ref_loss"]) <= TOL * abs(m["ref_loss"]), where
            assert m["grad_err"] <= TOL, (where, m["worst"], m["grad_err"])
        tiles = per_case["uneven tiles"]["tiles"]
        assert tiles["calls"] == 1 and tiles["backward_tiles"] == tiles["forward_tiles"], (rank, tiles)
        # the video's call tiled, and the images' (shared by patches, one tile; by items before 5.15, where the towers
        # take no per-patch tables)
        assert per_case["tiled and untiled calls"]["tiles"]["calls"] == 2, rank
        assert per_case["untiled calls"]["tiles"]["calls"] == 0, rank
        assert per_case["every item in tiles"]["tiles"]["calls"] == 2, rank  # images, video: each call whole, tiled


# CP off (P=1): the default is the stock tower bit for bit; an explicit setting tiles every call of the tower, exactly

P1_CASES = [  # (family, gradient checkpointing, layout)
    ("qwen3_vl", False, MULTI_IMAGE),  # images only: one tower call
    ("qwen3_vl", True, VIDEO_GROUPS),  # a video of four temporal groups beside two images: two calls
    ("qwen3_5", "reentrant", TWO_VIDEOS),  # no deepstack levels
]


def _p1_step(model, batch: dict, **settings) -> tuple[torch.Tensor, dict, dict]:
    """Loss, gradients and the tower's tiles of one training step at P=1 with `settings` (the package reverted for
    none: stock)."""
    import vlmcp_patch
    from tests.helpers.tile_cases import stock_step
    from vlmcp_patch.vision_tiles import VISION_TILES

    if not settings:
        vlmcp_patch.revert()
        try:
            return (*stock_step(model, batch), {})
        finally:
            vlmcp_patch.apply()
    vlmcp_patch.enable(cp_size=1, **settings)
    VISION_TILES.drain()
    try:
        loss, grads = stock_step(model, batch)
    finally:
        vlmcp_patch.enable(vision_tile_patches="auto", device_memory_gib=0)
    return loss, grads, VISION_TILES.drain()


@pytest.mark.parametrize("setting", ["auto", 0])
def test_cp_off_default_is_the_stock_tower_bit_for_bit(setting, reapply):
    """With CP off (P=1), `auto` (with a budget nothing fits: the choice by need acts under CP only) and `0` change
    nothing: no tile runs, the loss and every gradient equal stock's bit for bit."""
    model, batch = _model_and_batch("qwen3_vl", True, VIDEO_GROUPS)
    ref_loss, ref_grads, _ = _p1_step(model, batch)
    loss, grads, tiles = _p1_step(model, batch, vision_tile_patches=setting, device_memory_gib=1e-9)
    assert tiles["calls"] == 0
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys() and all(torch.equal(grads[n], ref_grads[n]) for n in grads)


@pytest.mark.parametrize("family, checkpointing, layout", P1_CASES, ids=lambda c: c if isinstance(c, str) else None)
def test_explicit_tiles_with_cp_off_equal_the_stock_tower(family, checkpointing, layout, reapply):
    """`VLMCP_VISION_TILE_PATCHES=16` at P=1 (a tile per temporal group or image, several per call): every call of
    the tower runs its items in tiles, recomputed in backward — with the blocks' gradient checkpointing on or off —
    and the loss and every parameter's gradient equal the stock tower's within 1e-5. The control: the tiles ran,
    several per call, each once forward and once recomputed in backward."""
    model, batch = _model_and_batch(family, checkpointing, layout)
    ref_loss, ref_grads, _ = _p1_step(model, batch)
    loss, grads, tiles = _p1_step(model, batch, vision_tile_patches=16)
    calls = sum(key in batch for key in ("pixel_values", "pixel_values_videos"))
    assert tiles["calls"] == calls and tiles["forward_tiles"] >= 2 * calls, tiles
    assert tiles["backward_tiles"] == tiles["forward_tiles"], tiles
    assert float((loss - ref_loss).abs()) <= TOL * float(ref_loss.abs())
    assert grads.keys() == ref_grads.keys()
    errors, _ = gradient_errors(grads, ref_grads)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOL, (worst, errors[worst])


def test_one_tile_with_cp_off_still_takes_the_tiled_function(reapply):
    """A switch that is on takes the tiled function even where a call makes one tile (tiles of a million patches):
    the gradients' arrival then depends on the switch, not the row. One tile is exact: the loss and every gradient
    within 1e-5 of stock's."""
    model, batch = _model_and_batch("qwen3_vl", False, VIDEO_GROUPS)
    ref_loss, ref_grads, _ = _p1_step(model, batch)
    loss, grads, tiles = _p1_step(model, batch, vision_tile_patches="on")
    assert tiles == {"calls": 2, "forward_tiles": 2, "backward_tiles": 2}, tiles
    assert float((loss - ref_loss).abs()) <= TOL * float(ref_loss.abs())
    errors, _ = gradient_errors(grads, ref_grads)
    assert max(errors.values()) <= TOL


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_the_tiled_tower_returns_what_the_stock_tower_returns(family, reapply):
    """With CP off and tiles set, the tower's call returns the stock output class: the merged features and each
    deepstack level (Qwen3-VL; Qwen3.5 has none) whole, equal to stock's within 1e-5, with the pixels' gradient
    (pixels that require one) and every weight's; `last_hidden_state`, which stock's `get_image_features` never reads,
    None. A call asking for the blocks' hidden states runs the stock tower (no tile)."""
    import vlmcp_patch
    from vlmcp_patch.vision_tiles import VISION_TILES

    model, batch = _model_and_batch(family, False, VIDEO_GROUPS)
    tower = model.model.visual
    grid = batch["video_grid_thw"]

    def features(**settings):
        vlmcp_patch.enable(cp_size=1, **settings)
        pixels = batch["pixel_values_videos"].clone().requires_grad_(True)
        tower.zero_grad(set_to_none=True)
        VISION_TILES.drain()
        try:
            out = tower(pixels, grid_thw=grid, return_dict=True)
        finally:
            vlmcp_patch.enable(vision_tile_patches="auto")
        fields = [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]
        weights = torch.randn(torch.cat(fields, -1).shape, generator=torch.Generator().manual_seed(0))
        (torch.cat(fields, -1) * weights).sum().backward()
        return out, fields, [p.grad for p in tower.parameters()] + [pixels.grad], VISION_TILES.drain()

    ref, ref_fields, ref_grads, untiled = features(vision_tile_patches=0)
    out, fields, grads, tiles = features(vision_tile_patches=16)
    groups = int(grid[:, 0].sum())  # of 16 patches each: a tile each
    assert untiled["calls"] == 0 and tiles == {"calls": 1, "forward_tiles": groups, "backward_tiles": groups}, tiles
    assert type(out) is type(ref) and out.last_hidden_state is None and ref.last_hidden_state is not None
    assert [f.shape for f in fields] == [f.shape for f in ref_fields]
    assert (len(fields) > 1) == (family == "qwen3_vl")  # the deepstack levels
    for got, want in zip(fields + grads, ref_fields + ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

    vlmcp_patch.enable(cp_size=1, vision_tile_patches=16)
    VISION_TILES.drain()
    try:
        with torch.no_grad():
            hidden = tower(batch["pixel_values_videos"], grid_thw=grid, output_hidden_states=True)
    finally:
        vlmcp_patch.enable(vision_tile_patches="auto")
    assert VISION_TILES.drain()["calls"] == 0 and hidden.hidden_states is not None


@pytest.mark.parametrize("setting, tiled", [(10**6, True), ("on", True), ("auto", False), (0, False)])
def test_a_switch_that_is_on_tiles_every_share_even_of_one_tile(setting, tiled, reapply):
    """The group's path is set by the switch alone: on, every rank goes through the tiled function even where each
    share makes one tile (so the vision gradients arrive in one order whatever the row); off (or `auto` with nothing
    chosen), none does."""
    import vlmcp_patch
    from vlmcp_patch.vision_tiles import tiling_applies

    model, _ = _model_and_batch("qwen3_vl", False, VIDEO_GROUPS)
    vlmcp_patch.enable(cp_size=1, vision_tile_patches=setting)
    try:
        assert tiling_applies(model.model.visual) is tiled
    finally:
        vlmcp_patch.enable(vision_tile_patches="auto")


def test_zero_replicas_with_cp_off_take_the_tiled_function_whatever_their_tiles():
    """DeepSpeed ZeRO-2 at P=1 over two data replicas (gloo), each its own row, `VLMCP_VISION_TILE_PATCHES=32`: rank
    0's video makes four tiles, rank 1's one, which goes through the tiled function too, so the vision gradients
    arrive in the same order on both replicas and every reduced gradient equals stock's mean over the two rows within
    1e-5. Rank 1 untiled (`0`) with the passes matched (`VLMCP_MATCH_VISION_PASSES=1`): its call goes through the
    tiled function all the same, one tile (one order across replicas, `vision_tiles.one_order_required`), exactly.
    The control: the same without matching, its vision gradients arriving block by block against rank 0's all at
    once — ZeRO-2 reduces its flat buckets as packed in arrival order, and sums different parameters' gradients.
    A replica with text alone runs its placeholder pass through the tiled function too. ZeRO-3 at P=1 gathers the
    tower module by module (the integration makes it a leaf under CP only): it runs untiled on both replicas,
    exactly."""
    pytest.importorskip("deepspeed")
    cases = run_distributed(run_replica_cases, 2, timeout=600)
    same, matched, mixed, placeholder, zero3 = ([r[name] for r in cases] for name, *_ in REPLICA_CASES)
    assert [r["tiles"] for r in same] == [{"calls": 1, "forward_tiles": 4, "backward_tiles": 4},
                                          {"calls": 1, "forward_tiles": 1, "backward_tiles": 1}]
    assert all(r["grad_err"] <= TOL for r in same), same
    assert matched[1]["tiles"] == {"calls": 1, "forward_tiles": 1, "backward_tiles": 1}, matched
    assert all(r["grad_err"] <= TOL for r in matched), matched
    assert mixed[1]["tiles"]["calls"] == 0 and mixed[0]["grad_err"] > 1e-2, mixed
    # a replica whose row is text alone runs a placeholder through the tower (`VLMCP_MATCH_VISION_PASSES=1`): one tile
    assert placeholder[1]["tiles"] == {"calls": 1, "forward_tiles": 1, "backward_tiles": 1}, placeholder
    assert all(r["grad_err"] <= TOL for r in placeholder), placeholder
    assert [r["tiles"]["calls"] for r in zero3] == [0, 0] and all(r["grad_err"] <= TOL for r in zero3), zero3


def test_tiles_are_whole_temporal_groups_in_order():
    """Units (frames, height, width) split into their temporal groups, packed in pixel-row order up to the budget, a
    larger group alone; consecutive groups of one unit one grid row."""
    tiles = plan_tiles([(3, 4, 4), (1, 2, 4), (2, 4, 6)], budget=40, merge_unit=4)
    assert tiles == [Tile((0, 32), ((2, 4, 4),), (0, 8)), Tile((32, 56), ((1, 4, 4), (1, 2, 4)), (8, 14)),
                     Tile((56, 80), ((1, 4, 6),), (14, 20)), Tile((80, 104), ((1, 4, 6),), (20, 26))]
    assert [t.grid for t in plan_tiles([(3, 4, 4)], budget=1, merge_unit=4)] == [((1, 4, 4),)] * 3
    assert plan_tiles([(3, 4, 4), (1, 2, 4)], budget=10**6, merge_unit=4) == [
        Tile((0, 56), ((3, 4, 4), (1, 2, 4)), (0, 14))]


@pytest.mark.parametrize("patches, configured, expected", [
    (1_000_000, "auto", 6_411),  # 156 tiles: a tile's activations within the share's kept features
    (20_000, "auto", 5_000),  # the tile's floor, MIN_TILE, in equal tiles
    (3_000, "auto", 3_000),  # shorter than a tile: one tile (still through the tiled function)
    (100, 7, 7),
    (100, 0, 100),  # 0: untiled
])
def test_tile_size(patches, configured, expected):
    # Qwen3-VL-8B's tower: 27 blocks of width 1152 and MLP 4304, features 4096 x (1 + 3 deepstack levels) per merged
    # token of 4 patches
    work, kept = 27 * (13 * 1152 + 2 * 4304), 4096 * 4 / 4
    assert tile_patches(patches, work, kept, configured) == expected


def test_tiles_equal_the_whole_tower_with_pixel_gradients():
    """The function alone on a real tower (tiny Qwen3-VL, a video of eight temporal groups, tiles of three groups and
    less): the features, the pixels' gradient and every weight's gradient equal the whole tower's, each weight's
    gradient accumulated once."""
    from tests.helpers.vision_tile_cases import VIDEO_GROUPS, _model_and_batch
    from vlmcp_patch.forward.vision import _joined_features, _TiledOutput
    from vlmcp_patch.vision_tiles import VISION_TILES, vision_in_tiles

    model, batch = _model_and_batch("qwen3_vl", False, VIDEO_GROUPS)
    tower = model.model.visual
    pixels = batch["pixel_values_videos"].clone().requires_grad_(True)
    grid = batch["video_grid_thw"]
    whole = _joined_features(tower(pixels, grid_thw=grid))
    weights = torch.randn(whole.shape, generator=torch.Generator().manual_seed(0))
    (whole * weights).sum().backward()
    expected = [p.grad.clone() for p in tower.parameters()] + [pixels.grad.clone()]
    tower.zero_grad(set_to_none=True)
    pixels.grad = None
    fired = []
    for p in tower.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    tiles = plan_tiles(grid.tolist(), budget=3 * 16, merge_unit=4)
    encode = _TiledOutput()
    VISION_TILES.drain()
    placement = {"device": pixels.device, "dtype": pixels.dtype}
    tiled = vision_in_tiles(lambda tile, rows: encode.joined(tower(rows, grid_thw=torch.tensor(tile.grid))), tower,
                            tiles, placement, pixels, None, list(tower.parameters()))
    (tiled * weights).sum().backward()
    assert len(tiles) == 3 and VISION_TILES.drain() == {"calls": 1, "forward_tiles": 3, "backward_tiles": 3}
    torch.testing.assert_close(tiled, whole, rtol=1e-5, atol=1e-6)
    assert len(fired) == len(list(tower.parameters()))  # once each
    for got, want in zip([p.grad for p in tower.parameters()] + [pixels.grad], expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.integration
def test_tiles_in_bf16_are_as_near_the_exact_gradient_as_the_untiled_tower(capsys):
    """bf16 tower (tiny Qwen3-VL, a video of 128 temporal groups of 2 x 2 patches): every weight's gradient summed over
    the tiles in fp32 and cast once stays within 1.1 x the untiled tower's error against fp64 at 1, 16 and 128 tiles
    (summed in bf16: 1.38 x at 16, 2.66 x at 128). Integration tier: 128 tiles of the tower are slow on a loaded CPU;
    the default tier checks the same function (`tiled_recompute.py`) on the MLPs and norms."""
    from tests.helpers.tile_cases import BF16_TILE_COUNTS, bf16_gradient_errors
    from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_vl_config
    from vlmcp_patch.forward.vision import _joined_features, _TiledOutput
    from vlmcp_patch.vision_tiles import vision_in_tiles

    tower = build_model(tiny_qwen3_vl_config(), seed=1).model.visual.double()
    grid = torch.tensor([[128, 2, 2]])
    c = tower.config
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randn(512, c.in_channels * c.temporal_patch_size * c.patch_size**2, dtype=torch.float64,
                         generator=generator)
    grad = torch.randn(_joined_features(tower(pixels, grid_thw=grid)).shape, dtype=torch.float64, generator=generator)

    def step(tower, tiles):
        dtype = tower.dtype
        if tiles == 0:
            out = _joined_features(tower(pixels.to(dtype), grid_thw=grid))
        else:
            tiled, encode = plan_tiles(grid.tolist(), budget=512 // tiles, merge_unit=4), _TiledOutput()
            assert len(tiled) == tiles
            out = vision_in_tiles(lambda tile, rows: encode.joined(tower(rows, grid_thw=torch.tensor(tile.grid))),
                                  tower, tiled, {"device": pixels.device, "dtype": dtype}, pixels.to(dtype), None,
                                  list(tower.parameters()))
        out.backward(grad.to(dtype))

    errors = bf16_gradient_errors(tower, step)
    with capsys.disabled():
        print(f"\nvision tower bf16 gradient error against fp64 by tiles (0: untiled): {errors}")
    for tiles in BF16_TILE_COUNTS:
        assert errors[tiles] <= 1.1 * errors[0], (tiles, errors)


def test_a_cp_step_moves_each_tiles_pixel_rows_not_the_share():
    """A real CP step at P=2 with the pixels where the tower is not (every move of the caller's pixels copies, as from
    the host): untiled, each rank moves its share once; in tiles, only a tile's rows at a time, forward and again in
    the tile's recompute — the share's rows twice over, never the share at once (`forward.vision.encode_items` hands
    the tiled tower the caller's view). The loss is the same either way."""
    results = run_distributed(run_pixel_moves, 2, timeout=600)
    for rank, by_tile in enumerate(results):
        (share,), tiled = by_tile[0]["rows"], by_tile[32]["rows"]
        assert len(tiled) >= 4 and sum(tiled) == 2 * share, (rank, by_tile)
        assert max(tiled) < share, (rank, by_tile)
        assert by_tile[32]["loss"] == pytest.approx(by_tile[0]["loss"], rel=1e-6)


def test_each_tile_moves_its_own_pixel_rows_when_it_runs():
    """Pixels where the tower is not (the host under CP; here another dtype, which moves them the same way): each
    tile's rows are moved to the tower's device and dtype when the tile runs, in forward and again in its recompute,
    so no copy of the whole share is ever made; the features equal the whole tower's on the moved pixels."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tests.helpers.vision_tile_cases import VIDEO_GROUPS, _model_and_batch
    from vlmcp_patch.forward.vision import _joined_features, _TiledOutput
    from vlmcp_patch.vision_tiles import vision_in_tiles

    model, batch = _model_and_batch("qwen3_vl", False, VIDEO_GROUPS)
    tower = model.model.visual
    pixels, grid = batch["pixel_values_videos"].double(), batch["video_grid_thw"]  # "the host's": float64
    whole = _joined_features(tower(pixels.float(), grid_thw=grid))

    class Moves(TorchDispatchMode):
        rows: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and args[0].dtype == torch.float64:
                self.rows.append(out.shape[0])
            return out

    tiles = plan_tiles(grid.tolist(), budget=3 * 16, merge_unit=4)
    encode = _TiledOutput()
    with Moves() as moves:
        tiled = vision_in_tiles(lambda tile, rows: encode.joined(tower(rows, grid_thw=torch.tensor(tile.grid))),
                                tower, tiles, {"device": pixels.device, "dtype": torch.float32}, pixels, None,
                                list(tower.parameters()))
        tiled.sum().backward()
    per_tile = [tile.rows[1] - tile.rows[0] for tile in tiles]
    assert moves.rows == per_tile + per_tile  # forward, then the recompute: a tile's rows each time
    assert max(moves.rows) < pixels.shape[0]
    torch.testing.assert_close(tiled, whole, rtol=1e-5, atol=1e-6)
