"""The memory switches chosen by need (`vlmcp_patch/by_need.py`), the line that says so, and explicit tiles at P=1.

Under CP each forward prices its row with the plan's model and turns on the cheapest set of switches that fits the
room the group agrees on; explicit settings win; a row that fits nowhere is refused on every rank with what would fit
it. The replicas run one set (their gradients then arrive in one order), and each forward's recomputation runs under
its own choice. At P=1 nothing is chosen: the default stays stock bit for bit, and explicit tiles act (exactly)."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from tests.helpers.harness import run_distributed
from tests.helpers.parity import TOL

GIB = 2**30


@pytest.fixture
def settings_back(reapply):
    """Whatever a test sets, the switches come back to their defaults (by need) and the choice is forgotten."""
    from vlmcp_patch import by_need

    by_need.STATE.choice, by_need.STATE.logged, by_need.STATE.p1_logged = None, None, False
    yield
    import vlmcp_patch

    vlmcp_patch.enable(mlp_tile_tokens="auto", recompute_norms="auto", vision_tile_patches="auto",
                       loss_chunk_tokens=0, device_memory_gib=0, host_memory_gib=0)
    by_need.STATE.choice, by_need.STATE.logged, by_need.STATE.p1_logged = None, None, False


# ---------------------------------------------------------------------------------------------------------------
# The rule, priced on a released model's dimensions (no compute)


def _priced(size: int = 8):
    """Qwen3-VL-8B, a 1M-token video row at P=`size` with checkpointing and ZeRO-3: the base Training and each
    allowed set's predicted peak."""
    from vlmcp_patch import by_need
    from vlmcp_patch.planning import Row, Training, model_dims, package_ulysses

    dims = model_dims("qwen3-vl-8b")
    row = Row.video(2**20)
    base = Training(gradient_checkpointing=True, sharding="zero3", tiled_mlp=False, tiled_vision=False,
                    recompute_norms=False)
    ulysses = package_ulysses(dims, size)
    sets = {s: by_need.predicted_peak(dims, row, by_need._with(base, s), size, ulysses) for s in by_need.candidates()}
    return dims, row, base, ulysses, sets


def test_the_cheapest_set_that_fits_is_chosen(settings_back):
    from vlmcp_patch import by_need

    dims, row, base, ulysses, sets = _priced()
    untiled, least = sets[by_need.Switches()], min(sets.values())
    assert least < 0.8 * untiled  # the switches matter on this row: the rule has something to choose
    # roomy: nothing on, stock speed
    chosen, peak, why = by_need.choose(dims, row, base, 8, ulysses, 1.1 * untiled)
    assert chosen == by_need.Switches() and peak == untiled and "fits without" in why
    for room in (0.5 * (untiled + least), 1.01 * least):
        chosen, peak, why = by_need.choose(dims, row, base, 8, ulysses, room)
        assert peak <= room < untiled and chosen.on()
        # no cheaper set fits: every set of lower cost is priced above the room
        assert all(p > room for s, p in sets.items() if s.cost() < chosen.cost()), (chosen, room)
    # an explicit switch wins: MLP tiles set off are never chosen, and where they alone would fit the row, the refusal
    # names them
    import vlmcp_patch

    vlmcp_patch.enable(mlp_tile_tokens=0)
    assert not any(s.mlp for s in by_need.candidates())
    without_mlp = min(p for s, p in sets.items() if not s.mlp)
    if least < without_mlp:
        with pytest.raises(vlmcp_patch.UnsupportedSetupError, match="VLMCP_MLP_TILE_TOKENS=auto"):
            by_need.choose(dims, row, base, 8, ulysses, 0.5 * (least + without_mlp))


def test_a_row_that_fits_nowhere_is_refused_with_the_longest_row_and_the_p_that_fit(settings_back):
    import vlmcp_patch
    from vlmcp_patch import by_need

    dims, row, base, ulysses, sets = _priced()
    room = 0.8 * min(sets.values())
    with pytest.raises(vlmcp_patch.UnsupportedSetupError) as refused:
        by_need.choose(dims, row, base, 8, ulysses, room)
    text = str(refused.value)
    longest = int(re.search(r"fits as set: ([\d,]+) tokens", text).group(1).replace(",", ""))
    everything = by_need._with(base, by_need.Switches(True, True, True, True))
    assert 0 < longest < row.tokens
    assert by_need.predicted_peak(dims, by_need._scaled(row, longest / row.tokens), everything, 8, ulysses) <= room
    longer = by_need._scaled(row, 1.02 * longest / row.tokens)
    assert by_need.predicted_peak(dims, longer, everything, 8, ulysses) > room
    fits_at = int(re.search(r"VLMCP_CP_SIZE=(\d+)", text).group(1))
    from vlmcp_patch.planning import package_ulysses

    assert by_need.predicted_peak(dims, row, everything, fits_at, package_ulysses(dims, fits_at)) <= room
    assert by_need.predicted_peak(dims, row, everything, fits_at // 2, package_ulysses(dims, fits_at // 2)) > room


def test_the_settings_are_auto_by_need_or_explicit(monkeypatch):
    from vlmcp_patch import settings

    assert settings._from_environment().recompute_norms == settings.AUTO  # the default: by need
    for raw, want in (("auto", "auto"), ("on", "on"), ("0", 0), ("4096", 4096)):
        monkeypatch.setenv("VLMCP_MLP_TILE_TOKENS", raw)
        monkeypatch.setenv("VLMCP_VISION_TILE_PATCHES", raw)
        read = settings._from_environment()
        assert read.mlp_tile_tokens == want and read.vision_tile_patches == want
    for raw, want in (("auto", "auto"), ("1", True), ("0", False)):
        monkeypatch.setenv("VLMCP_RECOMPUTE_NORMS", raw)
        monkeypatch.setenv("VLMCP_OFFLOAD_FEATURES", raw)
        read = settings._from_environment()
        assert read.recompute_norms == want and read.offload_features == want
    monkeypatch.setenv("VLMCP_DEVICE_MEMORY_GIB", "12.5")
    assert settings._from_environment().device_memory_gib == 12.5
    monkeypatch.setenv("VLMCP_DEVICE_MEMORY_GIB", "lots")
    with pytest.raises(settings.UnsupportedSetupError, match="VLMCP_DEVICE_MEMORY_GIB"):
        settings._from_environment()


# ---------------------------------------------------------------------------------------------------------------
# P=1: the default is stock; explicit tiles act, exactly


def _tiny():
    from tests.helpers.tile_cases import _model_and_batch

    return _model_and_batch("qwen3_vl", "moe_multi_image")


def test_p1_default_is_stock_bit_for_bit_and_says_nothing(settings_back, caplog):
    """At P=1 nothing is chosen by need, whatever the budget: no tile, no line, stock's bits."""
    import vlmcp_patch
    from tests.helpers.tile_cases import stock_step
    from vlmcp_patch.tiles import NORMS, TILES

    model, batch = _tiny()
    vlmcp_patch.revert()
    ref_loss, ref_grads = stock_step(model, batch)
    vlmcp_patch.apply()
    vlmcp_patch.enable(cp_size=1, device_memory_gib=1e-9)  # a budget nothing fits: by need acts under CP only
    TILES.drain(), NORMS.drain()
    with caplog.at_level(logging.INFO, logger="vlmcp_patch"):
        loss, grads = stock_step(model, batch)
    assert TILES.drain()["calls"] == 0 and NORMS.drain()["calls"] == 0
    assert not [r for r in caplog.records if r.name == "vlmcp_patch"]
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys() and all(torch.equal(grads[n], ref_grads[n]) for n in grads)


def test_explicit_tiles_at_p1_engage_and_equal_stock(settings_back, caplog):
    """`VLMCP_MLP_TILE_TOKENS=3` and `VLMCP_RECOMPUTE_NORMS=1` at P=1: every MLP runs in tiles and every norm is
    recomputed (the telemetry counts them), the loss and every gradient within 1e-5 of stock (fp32), and one line says
    so."""
    import vlmcp_patch
    from tests.helpers.tile_cases import stock_step
    from vlmcp_patch.tiles import NORMS, TILES

    model, batch = _tiny()
    vlmcp_patch.revert()
    ref_loss, ref_grads = stock_step(model, batch)
    vlmcp_patch.apply()
    vlmcp_patch.enable(cp_size=1, mlp_tile_tokens=3, recompute_norms=True)
    TILES.drain(), NORMS.drain()
    with caplog.at_level(logging.INFO, logger="vlmcp_patch"):
        loss, grads = stock_step(model, batch)
        stock_step(model, batch)
    tiles, norms = TILES.drain(), NORMS.drain()
    assert tiles["calls"] > 0 and tiles["forward_tiles"] >= 3 * tiles["calls"] and tiles["backward_tiles"] > 0, tiles
    assert norms["calls"] > 0 and norms["backward_tiles"] > 0, norms
    lines = [r.getMessage() for r in caplog.records if r.name == "vlmcp_patch"]
    assert len(lines) == 1 and "P=1" in lines[0] and "MLP tiles" in lines[0], lines
    torch.testing.assert_close(loss, ref_loss, rtol=TOL, atol=TOL)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=TOL, atol=TOL, msg=name)


def test_the_trainer_log_carries_the_choice(settings_back):
    """The package's HF Trainer callback adds the switches chosen and the predicted peak to each training log."""
    from transformers import TrainerControl, TrainerState, TrainingArguments

    import vlmcp_patch
    from vlmcp_patch import by_need
    from vlmcp_patch.callback import VLMCPCallback

    dims, row, base, ulysses, sets = _priced()
    least = min(sets.values())
    switches, peak, why = by_need.choose(dims, row, base, 8, ulysses, 1.01 * least)
    by_need.STATE.choice = by_need.Choice(switches, (), why, peak, 1.01 * least, row.tokens, row.patches(dims), 8,
                                          ulysses, 8 // ulysses, 1)
    vlmcp_patch.enable(cp_size=2)  # the callback alone: no collective runs, only the CP switch is read
    logs = {"loss": 1.0}
    VLMCPCallback().on_log(TrainingArguments(output_dir="/tmp/unused", report_to=[]), TrainerState(),
                           TrainerControl(), logs=logs)
    assert logs["cp_mlp_on"] == int(switches.mlp) and logs["cp_vision_on"] == int(switches.vision)
    assert logs["cp_predicted_peak_gib"] == round(peak / GIB, 3)


# ---------------------------------------------------------------------------------------------------------------
# Under CP (P=2, gloo): three budgets, a refusal, the line


@pytest.mark.integration
def test_switches_by_need_at_three_budgets_and_a_refusal(once):
    from tests.helpers.by_need_cases import TOKENS, budgets

    ranks = once(run_distributed, budgets, 2)
    for rank, res in enumerate(ranks):
        roomy, medium, tight, refused = (res[name] for name in ("roomy", "medium", "tight", "refused"))
        assert roomy["switches"] == [] and roomy["mlp_tiles"] == roomy["vision_tiles"] == roomy["norm_calls"] == 0
        assert medium["switches"] and len(medium["switches"]) < len(tight["switches"]), (medium, tight)
        assert "mlp" in tight["switches"] and "vision" in tight["switches"], tight
        for name, run in (("roomy", roomy), ("medium", medium), ("tight", tight)):
            where = f"rank {rank}, {name}"
            assert run["predicted"] <= run["room"] < run["budget"], where
            assert run["peak"] <= run["budget"], (where, run["peak"] / GIB, run["budget"] / GIB)  # measured
            assert (run["mlp_tiles"] > 0) == ("mlp" in run["switches"]), where  # the switches chosen ran
            assert (run["vision_tiles"] > 0) == ("vision" in run["switches"]), where
            assert (run["norm_calls"] > 0) == ("norms" in run["switches"]), where
            assert abs(run["loss"] - roomy["loss"]) <= TOL * abs(roomy["loss"]), where  # exact either way
        assert abs(roomy["again"] - roomy["loss"]) <= TOL * abs(roomy["loss"])
        # the measured peak follows the choice: the tight budget's step holds less than the medium one's, which holds
        # less than the untiled one's
        assert tight["peak"] < medium["peak"] < roomy["peak"]
        # refused on every rank, before compute, naming the longest row that fits and the P that fits this one
        text = refused["refused"]
        longest = int(re.search(r"fits as set: ([\d,]+) tokens", text).group(1).replace(",", ""))
        assert 0 < longest < TOKENS and "VLMCP_CP_SIZE=4" in text, text
        # the line: rank 0 of the group only, once per choice (the second roomy step said nothing)
        if rank == 0:
            for run in (roomy, medium, tight):
                (line,) = run["lines"]
                assert "P=2 (U x R = 2 x 1), 1 data replica" in line and "predicted peak" in line, line
                for switch in ("MLP tiles", "norm recompute", "vision tiles", "loss chunk"):
                    assert switch in line, line
            assert "MLP tiles on" in tight["lines"][0] and "the cheapest set that fits" in tight["lines"][0]
            assert "fits without switches" in roomy["lines"][0]
        else:
            assert all(not run["lines"] for run in (roomy, medium, tight)), rank


@pytest.mark.integration
def test_the_features_go_to_the_host_by_need_and_change_no_bit():
    """With the checkpoint offload on and the features the only switch left to the need: at a budget between the row's
    prices with the features on the device and on the host they are parked (the tensors counted) and the step's loss
    and gradients are the same bits as at a roomy budget, where they stay on the device (the control)."""
    from tests.helpers.by_need_cases import features_by_need

    for rank, res in enumerate(run_distributed(features_by_need, 2, timeout=600)):
        kept, parked = res["prices"]
        assert parked < kept, res["prices"]
        needed, roomy = res["needed"], res["roomy"]
        assert "features" in needed["switches"] and "features" not in roomy["switches"], (rank, needed, roomy)
        # the merged features and the three deepstack levels parked, their gradients handed back once
        assert needed["counts"]["parked"] == 4 and needed["counts"]["unparked"] == 1, needed["counts"]
        assert roomy["counts"]["parked"] == roomy["counts"]["unparked"] == 0, roomy["counts"]
        assert needed["loss"] == roomy["loss"] and res["same_bits"], rank


def test_a_host_that_cannot_hold_the_features_refuses_on_every_rank_before_compute():
    """Only the parked features fit the device, and one rank's host room is below the pool and features they need:
    every rank raises, naming the host, before anything is parked; with the room lifted the same step parks them."""
    from tests.helpers.by_need_cases import features_short_of_host

    for rank, res in enumerate(run_distributed(features_short_of_host, 2, timeout=600)):
        short, lifted = res["short"], res["lifted"]
        assert short["error"] and "UnsupportedSetupError" in short["error"] and "host cannot hold" in short["error"]
        assert not any(short["counts"].values()), (rank, short)
        assert lifted["error"] is None and "features" in lifted["switches"], (rank, lifted)
        assert any(lifted["counts"].values()), (rank, lifted)


def test_the_features_are_chosen_only_with_the_offload_and_as_set(settings_back):
    """On Qwen3-VL-8B's 4M-token video row at P=8 with the tiles and norms on: the features on the host are a candidate
    only with the checkpoint offload on; a room between the two prices takes them, a roomy one leaves them; set to 0
    they are never chosen, set to 1 always."""
    import vlmcp_patch
    from vlmcp_patch import by_need
    from vlmcp_patch.planning import Row, Training, model_dims, package_ulysses

    dims, row, ulysses = model_dims("qwen3-vl-8b"), Row.video(4 * 2**20), package_ulysses(model_dims("qwen3-vl-8b"), 8)
    vlmcp_patch.enable(mlp_tile_tokens="on", vision_tile_patches="on", recompute_norms=True, loss_chunk_tokens=4096)
    assert not any(s.features for s in by_need.candidates())  # no offload: never by need
    vlmcp_patch.enable(offload_checkpoints=True)
    try:
        base = Training(gradient_checkpointing=True, sharding="zero3", offload_checkpoints=True, offload_optimizer=True)
        sets = {s: by_need.predicted_peak(dims, row, by_need._with(base, s), 8, ulysses) for s in by_need.candidates()}
        assert [s.on() for s in sets] == [["norms", "vision", "mlp"], ["norms", "vision", "mlp", "features"]]
        kept, parked = sets.values()
        assert parked < 0.9 * kept
        chosen, _, why = by_need.choose(dims, row, base, 8, ulysses, (kept + parked) / 2)
        assert chosen.features and "features on host" in why
        assert not by_need.choose(dims, row, base, 8, ulysses, 1.1 * kept)[0].features
        vlmcp_patch.enable(offload_features=False)
        assert not any(s.features for s in by_need.candidates())
        vlmcp_patch.enable(offload_features=True)
        assert all(s.features for s in by_need.candidates())
    finally:
        vlmcp_patch.enable(offload_checkpoints=False, offload_features="auto")


def test_features_the_host_cannot_hold_are_passed_over_or_refused_by_the_host(settings_back):
    """On Qwen3-VL-8B's 4M-token video row at P=8 (checkpoints offloaded): with a device room only the parked
    features fit, a host room below their pool and features refuses, naming the host's need and room; above it,
    they are taken. With the norms left to the need too, a short host passes the features over for the next set
    that fits the device, and the choice says why."""
    import vlmcp_patch
    from vlmcp_patch import by_need
    from vlmcp_patch.errors import UnsupportedSetupError
    from vlmcp_patch.planning import Row, Training, model_dims, package_ulysses

    dims, row, ulysses = model_dims("qwen3-vl-8b"), Row.video(4 * 2**20), package_ulysses(model_dims("qwen3-vl-8b"), 8)
    base = Training(gradient_checkpointing=True, sharding="zero3", offload_checkpoints=True, offload_optimizer=True)
    vlmcp_patch.enable(mlp_tile_tokens="on", vision_tile_patches="on", recompute_norms=True, loss_chunk_tokens=4096,
                       offload_checkpoints=True)
    try:
        kept_set, parked_set = by_need.candidates()
        kept = by_need.predicted(dims, row, by_need._with(base, kept_set), 8, ulysses)
        parked = by_need.predicted(dims, row, by_need._with(base, parked_set), 8, ulysses)
        need = by_need.host_need(parked, parked_set)
        assert need == parked.host_pool + parked.host_features > parked.host_features > 0
        assert by_need.host_need(kept, kept_set) == 0
        room = (kept.total + parked.total) / 2
        with pytest.raises(UnsupportedSetupError, match=r"only with the vision features parked on the host.*need "
                           r"[\d.]+ GiB, and the host's room for them is [\d.]+ GiB") as refused:
            by_need.choose(dims, row, base, 8, ulysses, room, 0.9 * need)
        assert f"{need / 2**30:.2f} GiB" in str(refused.value) and f"{0.9 * need / 2**30:.2f} GiB" in str(refused.value)
        chosen, _, why = by_need.choose(dims, row, base, 8, ulysses, room, 1.1 * need)
        assert chosen.features and "would need" not in why
        vlmcp_patch.enable(recompute_norms="auto")  # now a cheaper-than-everything set fits the device without them
        sets = {tuple(s.on()): by_need.predicted(dims, row, by_need._with(base, s), 8, ulysses) for s in
                by_need.candidates()}
        # a room where the features alone (the cheaper switch) and the norms alone both fit the device
        roomy_enough = max(sets[("vision", "mlp", "features")].total, sets[("norms", "vision", "mlp")].total)
        chosen, _, why = by_need.choose(dims, row, base, 8, ulysses, roomy_enough, 1.0)
        assert not chosen.features and chosen.norms and "features on host would need" in why, why
        assert by_need.choose(dims, row, base, 8, ulysses, roomy_enough, None)[0].features  # no host limit known
        vlmcp_patch.enable(offload_features=True)  # explicit settings win: parked whatever the host's room
        for room in (roomy_enough, None):
            chosen, _, why = by_need.choose(dims, row, base, 8, ulysses, room, 1.0)
            assert chosen.features and "would need" not in why, why
    finally:
        vlmcp_patch.enable(offload_checkpoints=False, recompute_norms="auto", offload_features="auto")


def test_the_host_room_on_an_accelerator_is_the_nodes_available_memory_shared_by_its_ranks(monkeypatch, settings_back):
    """`local_host_room` off a CPU (the meta device stands in for an accelerator here): the kernel's available memory
    (within a cgroup's limit) over the ranks the launcher puts on the node, one without a launcher; a budget where
    set; nothing on a CPU without one."""
    import torch

    import vlmcp_patch
    from vlmcp_patch import by_need
    from vlmcp_patch.offload import HOST_CHECKPOINTS

    assert by_need._mem_available() > 0  # the kernel's reading (it moves between calls: fixed below)
    available = 24.0 * 2**30
    monkeypatch.setattr(by_need, "_mem_available", lambda: available)
    accelerator, held = torch.device("meta"), HOST_CHECKPOINTS.pool.reserved  # the pool's slabs count as room
    assert by_need.local_host_room(accelerator) == available + held  # one process, no launcher: one rank on the node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert by_need.local_host_room(accelerator) == available / 4 + held
    assert by_need.local_host_room(torch.device("cpu")) is None
    vlmcp_patch.enable(host_memory_gib=3)
    assert by_need.local_host_room(torch.device("cpu")) == by_need.local_host_room(accelerator) == 3 * 2**30


def test_on_uneven_nodes_the_host_room_is_shared_by_the_ranks_of_this_very_node(monkeypatch, settings_back):
    """SLURM's nodes of 8 and 4 ranks (`SLURM_TASKS_PER_NODE=8,4`, laid out in blocks of 4): each rank of the first
    node gets an eighth of its node's available memory, each of the second a quarter; the layout's node size (4) is
    not the count of a node. Every other launcher's local count is this node's count too."""
    import torch

    from tests.helpers.launcher_envs import NODE_VARIABLES, environment, slurm_task
    from vlmcp_patch import by_need
    from vlmcp_patch.launcher import launch
    from vlmcp_patch.offload import HOST_CHECKPOINTS

    available = 24.0 * 2**30
    monkeypatch.setattr(by_need, "_mem_available", lambda: available)
    accelerator, held = torch.device("meta"), HOST_CHECKPOINTS.pool.reserved

    def as_rank(rank: int, variables: dict[str, str]) -> None:
        for name in NODE_VARIABLES:
            monkeypatch.delenv(name, raising=False)
        for name, value in {"RANK": str(rank), "WORLD_SIZE": "12", **variables}.items():
            monkeypatch.setenv(name, value)

    for rank in (0, 7, 8, 11):
        node, local = (0, rank) if rank < 8 else (1, rank - 8)
        as_rank(rank, slurm_task(12, rank, node, local, "8,4"))
        assert launch().node_size == 4  # the layout's blocks: not a node's count
        share = 8 if node == 0 else 4
        assert launch().ranks_on_this_node == share
        assert by_need.local_host_room(accelerator) == available / share + held, rank
    as_rank(5, slurm_task(12, 5, 1, 1, "4(x3)"))  # the compressed form: nodes of 4
    assert by_need.local_host_room(accelerator) == available / 4 + held
    for launcher in ("torchrun", "deepspeed", "openmpi", "mpich"):
        as_rank(5, environment(launcher, 5, 12, 6))
        assert by_need.local_host_room(accelerator) == available / 6 + held, launcher


@pytest.mark.integration
def test_the_benchmark_prints_the_ratio_and_the_choice_time():
    """`python -m benchmarks.by_need` on a short row, one repeat, runs its three setups end to end (the numbers in
    docs/memory.md come from its full run) and prints what they ran and took, consistently: untiled and roomy run no
    switch, tight runs the cheapest set the plan prices within its room (the row chosen so that the untiled set does
    not fit it); with one repeat each median is its fastest; the ratios are those of the printed times, within a sane
    band (roomy runs the untiled step); the choice's own time per forward is a small part of the step."""
    from tests.helpers.by_need_cases import model_and_row, prices, rooms
    from tests.helpers.harness import ROOT, launch
    from vlmcp_patch.switches import Switches

    tokens, layers, size = 2048, 1, 2  # `--dry-run`'s 1024 tokens price every set within 2 % of untiled: no choice
    run = launch(ROOT / "benchmarks" / "by_need.py", ["--tokens", str(tokens), "--layers", str(layers),
                                                       "--repeats", "1", "--size", str(size)],
                 launcher="python", timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    # what the tight setup must choose: the cheapest set (`Switches.cost`) whose price fits its room
    priced = prices(*model_and_row(tokens, layers), size)
    room, untiled_price = rooms(priced)["tight"], priced["sets"][()]
    assert untiled_price > room, (untiled_price, room)  # the setup is tight: the control, or the check is vacuous
    fitting = [on for on, price in priced["sets"].items() if price <= room]
    must = min(fitting, key=lambda on: Switches(**dict.fromkeys(on, True)).cost())
    lines = {m.group(1): (float(m.group(2)), float(m.group(3)), m.group(4)) for m in re.finditer(
        r"^\s*(untiled|by need, roomy|by need, tight): median\s+([\d.]+) s, fastest\s+([\d.]+) s  switches: (.+)$",
        out, re.M)}
    assert lines.keys() == {"untiled", "by need, roomy", "by need, tight"}, out
    assert lines["untiled"][2] == lines["by need, roomy"][2] == "none", out
    assert tuple(lines["by need, tight"][2].split(", ")) == must, (must, out)
    for setup, (median, fastest, _) in lines.items():
        assert median == fastest > 0, (setup, out)  # one repeat: one step per rank
    ratios = {m.group(1): (float(m.group(2)), float(m.group(3))) for m in re.finditer(
        r"ratio by need \(roomy\) / untiled, (median|fastest): ([\d.]+) \(goal <= 1\.02\); tight / untiled "
        r"([\d.]+)", out)}
    assert ratios.keys() == {"median", "fastest"} and ratios["median"] == ratios["fastest"], out
    untiled, roomy, tight = (lines[s][0] for s in ("untiled", "by need, roomy", "by need, tight"))
    roomy_ratio, tight_ratio = ratios["median"]
    assert roomy_ratio == pytest.approx(roomy / untiled, rel=0.01, abs=2e-3), out
    assert tight_ratio == pytest.approx(tight / untiled, rel=0.01, abs=2e-3), out
    assert 1 / 3 < roomy_ratio < 3, out  # the same step (no switch either way); a wide band for a loaded machine
    choice = re.search(r"the choice per forward: ([\d.]+) ms \(([\d.e+-]+) of the untiled step\)", out)
    assert choice, out
    ms, share = float(choice.group(1)), float(choice.group(2))
    assert 0 < ms and share == pytest.approx(ms / 1e3 / untiled, rel=0.02, abs=1e-4), out
    assert share < 0.1, out  # pricing and one small all-reduce against a whole step


# ---------------------------------------------------------------------------------------------------------------
# Across replicas and across forwards (2 replicas x P=2, gloo): one switch set for every rank that reduces gradients
# together, and each forward's own choice in its recomputation


@pytest.fixture(scope="module")
def replicas_and_forwards():
    from tests.helpers.replica_choice_cases import replicas_and_forwards

    return run_distributed(replicas_and_forwards, 4, timeout=600)


@pytest.fixture(scope="module")
def references():
    """One process's stock gradients: each replica's row alone, both rows' sum, with the package reverted."""
    import vlmcp_patch
    from tests.helpers.replica_choice_cases import reference

    try:
        return {"short": reference(["short"]), "long": reference(["long"]), "both": reference(["long", "short"])}
    finally:
        vlmcp_patch.enable(cp_size=1)


def _assert_equal_grads(grads: dict, want: dict, where: str) -> None:
    assert grads.keys() == want.keys(), where
    for name, grad in grads.items():
        torch.testing.assert_close(torch.as_tensor(grad), want[name], rtol=TOL, atol=TOL, msg=f"{where}: {name}")


@pytest.mark.integration
@pytest.mark.parametrize("phase", ["agreed", "explicit"])
def test_replicas_run_one_switch_set_and_deliver_their_gradients_in_one_order(replicas_and_forwards, references,
                                                                             phase):
    """Replica 0 trains a short row that fits untiled, replica 1 a long one whose slice needs the MLP tiles (by need
    at one budget; or `VLMCP_MLP_TILE_TOKENS` set, where the short slice makes one tile and the long one two). Every
    rank ran the same switches, took the tiled MLP (one tile included), accumulated its parameters' gradients in the
    same order (the order ZeRO-1/2 fill their buckets in), and the world's sum of gradients equals one process's stock
    gradients of the two rows."""
    runs = [rank[phase] for rank in replicas_and_forwards]
    assert all(run["choices"] == [["mlp"]] for run in runs), [run["choices"] for run in runs]
    assert all(run["order"] == runs[0]["order"] for run in runs), "the replicas' gradients arrived in other orders"
    assert all(run["tiles"]["calls"] > 0 for run in runs)  # the short replica's one-tile MLPs ran the tiled function
    short, long = runs[0]["tiles"], runs[2]["tiles"]
    assert short["forward_tiles"] == short["calls"] and long["forward_tiles"] == 2 * long["calls"], (short, long)
    want = {n: references["short"][n] + references["long"][n] for n in references["short"]}
    for rank, run in enumerate(runs):
        _assert_equal_grads(run["grads"], want, f"rank {rank}, {phase}")


@pytest.mark.integration
def test_the_control_agreed_per_group_only_runs_other_switches_in_another_order(replicas_and_forwards):
    """The control (the old behaviour, the switches agreed within each CP group only): the short replica runs no
    switch, the long one the MLP tiles, and their gradients arrive in different orders — misaligned ZeRO-1/2
    buckets."""
    runs = [rank["per_group"] for rank in replicas_and_forwards]
    assert [run["choices"] for run in runs] == [[[]], [[]], [["mlp"]], [["mlp"]]]
    assert runs[0]["order"] == runs[1]["order"] and runs[2]["order"] == runs[3]["order"]
    assert runs[0]["order"] != runs[2]["order"]


@pytest.mark.integration
def test_a_replica_whose_row_fits_nowhere_stops_every_replica(replicas_and_forwards):
    """At a budget the long row fits nowhere, its replica's ranks raise the refusal (the longest row that fits) and
    the short row's replica, which fits, raises too, naming the other replica, before compute: no replica is left
    waiting in a gradient reduction the other never reaches."""
    refused = [rank["refused"] for rank in replicas_and_forwards]
    assert all(text is not None for text in refused), refused
    assert all("the row of data-parallel replica 1 (ranks 2..3) does not fit" in text for text in refused[:2]), \
        refused[:2]
    assert all("fits as set" in text for text in refused[2:]), refused[2:]


@pytest.mark.integration
def test_two_forwards_before_one_backward_each_recompute_with_their_own_choice(replicas_and_forwards, references):
    """The long row's forward (MLP tiles by need), then the short row's (none), then one backward of both losses'
    sum under non-reentrant gradient checkpointing: each checkpointed layer is recomputed with its own forward's
    switches, no error, and the group's gradients equal stock's. The control (the switches read from the last
    forward, the old behaviour) recomputes the long row's layers without their tiles: the checkpoint refuses."""
    for rank, result in enumerate(replicas_and_forwards):
        run = result["two_forwards"]
        assert run["choices"] == [["mlp"], []], run["choices"]
        assert "error" not in run, run.get("error")
        _assert_equal_grads(run["grads"], references["both"], f"rank {rank}, two forwards")
        control = result["two_forwards_global"]
        assert control["choices"] == [["mlp"], []]
        assert "CheckpointError" in control.get("error", ""), control.get("error")


def test_the_union_of_the_replicas_is_priced_for_each_row_and_holds_the_ordered_switches_only(settings_back):
    """The union the replicas run together holds the switches that set the gradients' arrival order (norms, MLP
    tiles), not the vision tiles (every tower call runs through one recomputed function where the order matters:
    `vision_tiles.one_order_required`): Qwen3-VL-8B at P=8, a short image-heavy row that fits with no switch runs the
    MLP tiles another replica needs, priced (`fit_the_union`), and keeps its own vision choice when another replica
    tiles its tower. Where the union fits some replica's row nowhere every rank of every replica raises, naming it."""
    import vlmcp_patch
    from vlmcp_patch import by_need
    from vlmcp_patch.planning import Row, Training, model_dims, package_ulysses

    vlmcp_patch.enable(offload_checkpoints=True)
    try:
        dims, ulysses = model_dims("qwen3-vl-8b"), package_ulysses(model_dims("qwen3-vl-8b"), 8)
        base = Training(gradient_checkpointing=True, sharding="zero3", offload_checkpoints=True,
                        tiled_mlp=False, tiled_vision=False, recompute_norms=False)
        short = Row.from_items(text=32768, images=((1344, 1344),) * 8)
        room = 6.5 * GIB
        own, peak, _ = by_need.choose(dims, short, base, 8, ulysses, room)
        assert not own.on() and peak <= room
        switches, union_peak, fits = by_need.fit_the_union(dims, short, base, 8, ulysses, room,
                                                           by_need.Switches(mlp=True))
        assert fits and switches.mlp and not switches.vision and union_peak <= room
        switches, _, fits = by_need.fit_the_union(dims, short, base, 8, ulysses, room, by_need.Switches(vision=True))
        assert fits and not switches.on()  # another replica's vision tiles are not asked of this one
        assert "vision" not in by_need.ORDERED
        text = by_need.union_does_not_fit(1, 8, by_need.Switches(mlp=True), 8.3 * GIB, room)
        assert "replica 1 (ranks 8..15)" in text and "MLP tiles" in text and "Every replica stops" in text
    finally:
        vlmcp_patch.enable(offload_checkpoints=False)


# ---------------------------------------------------------------------------------------------------------------
# A checkpoint function a user or a CLI installed (issue 64): it receives what transformers gives it


def layer_reading_checkpointing(gradient_checkpointing_func, record):
    """A checkpoint function of the kind CLIs install (LLaMA-Factory's `get_custom_gradient_checkpointing_func`, which
    finds the layer through `func.func.__self__`): it finds the layer in the partial transformers passes — a bound
    method's object (transformers 5.6: `partial(layer.__call__, **kwargs)`), or the partial's first argument (5.25:
    `partial(forward, layer, **kwargs)`) — and checkpoints only a layer with trained weights. `record(func, args)`
    sees each call's arguments. (The real LLaMA-Factory function runs in `test_llamafactorys_own_checkpoint_...`.)"""
    import functools
    import inspect

    def checkpointing(func, *args, **kwargs):
        record(func, args)
        inner = func.func if isinstance(func, functools.partial) else func
        layer = inner.__self__ if inspect.ismethod(inner) else func.args[0]
        if not any(p.requires_grad for p in layer.parameters()):
            return func(*args, **kwargs)
        return gradient_checkpointing_func(func, *args, **kwargs)

    return checkpointing


def _shape_of(func, args) -> tuple:
    """What a checkpoint function was given, as comparable values: a partial's function (bound: to which object, by
    identity) and name, its positional args and keywords (tensors by identity), the call's args."""
    import functools
    import inspect

    def value(v):
        return ("tensor", id(v)) if torch.is_tensor(v) else ("object", id(v)) if isinstance(v, torch.nn.Module) else v

    if not isinstance(func, functools.partial):
        return ("not a partial", type(func).__name__)
    inner = func.func
    bound = id(inner.__self__) if inspect.ismethod(inner) else None
    return (inspect.ismethod(inner), inspect.isfunction(getattr(inner, "__func__", inner)), bound, inner.__name__,
            tuple(map(value, func.args)), {k: value(v) for k, v in func.keywords.items()}, tuple(map(value, args)))


class _Layer(torch.nn.Module):
    """A layer that records the switch choice each of its runs (forward, recompute) saw."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.seen = []

    def forward(self, hidden_states, scale=1.0):
        from vlmcp_patch.switches import forward_choice

        self.seen.append(forward_choice())
        return self.linear(hidden_states).tanh() * scale


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("given", ["bound_call", "forward_and_layer"])
def test_an_installed_checkpoint_function_gets_transformers_partial_and_recomputes_under_each_forwards_choice(
        given, reentrant):
    """A CLI's kind of function (`layer_reading_checkpointing`) on a layer the package carries the choice through
    (`checkpoints_carry_the_choice`), called as transformers calls it — `partial(layer.__call__, **kwargs)` (5.6) or
    `partial(forward, layer, **kwargs)` (5.25): it gets a partial of the same shape, a method bound to the same layer
    or a function of the same name, with the same args and keywords (before issue 64 the partial wrapped a function
    of the package's, and a function reading `func.func.__self__` raised AttributeError); two forwards under two choices,
    then one backward, recompute each under its own choice, with stock's values and gradients."""
    import functools

    from vlmcp_patch.switches import checkpoints_carry_the_choice, under_choice

    received = []
    layer = _Layer()
    layer._gradient_checkpointing_func = layer_reading_checkpointing(
        functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=reentrant),
        lambda func, args: received.append(_shape_of(func, args)))
    checkpoints_carry_the_choice(layer)

    def transformers_partial(scale):
        return functools.partial(layer.__call__, scale=scale) if given == "bound_call" else \
            functools.partial(type(layer).forward, layer, scale=scale)

    x = torch.randn(3, 4, requires_grad=True)
    expected = [layer.linear(x).tanh() * s for s in (2.0, 3.0)]
    outputs = []
    for choice, scale in (("first", 2.0), ("second", 3.0)):
        func = transformers_partial(scale)
        with under_choice(choice):
            outputs.append(layer._gradient_checkpointing_func(func, x))
        assert received[-1] == _shape_of(func, (x,)), (received[-1], _shape_of(func, (x,)))
    (outputs[0].sum() + 2 * outputs[1].sum()).backward()
    assert layer.seen == ["first", "second", "second", "first"]  # the forwards, then each recompute (last first)
    grad, x.grad = x.grad, None
    (expected[0].sum() + 2 * expected[1].sum()).backward()
    for got, want in ((outputs[0], expected[0]), (outputs[1], expected[1]), (grad, x.grad)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    func = transformers_partial(1.0)
    layer._gradient_checkpointing_func(func, x)  # outside any CP forward: transformers' own partial, untouched
    assert received[-1] == _shape_of(func, (x,))


def cli_checkpointing_run(rank: int, world_size: int, family: str, case: str, real: bool = False) -> dict:
    """`compare` (stock, then CP) on a model checkpointed by a CLI's kind of function (`layer_reading_checkpointing`;
    `real`: LLaMA-Factory's own, installed), reentrant (LLaMA-Factory's default), installed as LLaMA-Factory installs
    it (`_set_gradient_checkpointing(gradient_checkpointing_func=...)`); what each of the recording function's calls
    was given, per run, as `_shape_of` with identities replaced by kinds (the layer's class, tensors). Where stock
    raises, the error each run raised."""
    import functools

    from tests.helpers.cases import FAMILIES, build_batch
    from tests.helpers.parity import compare
    from vlmcp_patch.fixtures.models import build_model
    from vlmcp_patch.patching import cp_size

    make_config, cases = FAMILIES[family]
    model = build_model(make_config(), seed=1)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    names = {id(m): type(m).__name__ for m in model.modules()}
    calls = {1: [], world_size: []}

    def kind(value):
        return names.get(value[1], "?") if isinstance(value, tuple) and value[:1] == ("object",) else \
            "tensor" if isinstance(value, tuple) and value[:1] == ("tensor",) else type(value).__name__

    def record(func, args):
        shape = _shape_of(func, args)
        if isinstance(func, functools.partial):  # identities and values as kinds
            shape = (*shape[:2], names.get(shape[2]), shape[3], tuple(map(kind, shape[4])),
                     # vlmcp_ctx: the package's forward passes its context to every layer under CP, as a keyword
                     sorted((k, kind(v)) for k, v in shape[5].items() if k != "vlmcp_ctx"), tuple(map(kind, shape[6])))
        calls[cp_size()].append(repr(shape))

    plain = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True)
    if real:
        from llamafactory.model.model_utils.checkpointing import get_custom_gradient_checkpointing_func

        recorded = get_custom_gradient_checkpointing_func(plain)

        def installed(func, *args, **kwargs):
            record(func, args)
            return recorded(func, *args, **kwargs)
    else:
        installed = layer_reading_checkpointing(plain, record)
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=installed)
    model.train()
    batch = build_batch(cases[case][1], seed=7)
    try:
        result = compare(model, batch, world_size)
    except Exception as error:  # noqa: BLE001 - stock's own outcome, and then the package's, compared by the test
        import vlmcp_patch

        vlmcp_patch.revert()
        try:
            model(**batch).loss.backward()
            stock = "ran"
        except Exception as stock_error:  # noqa: BLE001
            stock = f"{type(stock_error).__name__}: {stock_error}"
        finally:
            vlmcp_patch.apply()
        return {"error": f"{type(error).__name__}: {error}", "stock_error": stock}
    return {**result, "stock_calls": calls[1], "cp_calls": calls[world_size]}


def _same_as_stock(results: list) -> None:
    for rank, m in enumerate(results):
        if "error" in m:  # stock raises too (LLaMA-Factory 0.9.5 beside transformers past its pin): the same error
            assert m["error"] == m["stock_error"], (rank, m)
            continue
        assert m["loss_err"] <= TOL and m["grad_err"] <= TOL, (rank, m["worst_grad"])
        assert m["missing_grads"] == [], rank
        assert m["cp_calls"] and sorted(m["cp_calls"]) == sorted(m["stock_calls"]), \
            (rank, sorted(set(m["cp_calls"]) ^ set(m["stock_calls"]))[:4])


def test_a_clis_checkpoint_function_under_cp_equals_stock():
    """Issue 64: a CLI's kind of checkpoint function at CP = 2 (LLaMA-Factory's raised AttributeError on every rank at
    the first forward before): the loss and the gradients of stock, and its calls got what stock's got — partials of
    the same layers' functions, of the same kinds of arguments and keywords."""
    results = run_distributed(cli_checkpointing_run, 2, "qwen3_vl", "multi_image", timeout=600)
    assert all("error" not in m for m in results), results
    _same_as_stock(results)


def test_llamafactorys_own_checkpoint_function_under_cp_gives_stocks_outcome():
    """LLaMA-Factory 0.9.5's own `get_custom_gradient_checkpointing_func` (installed without its dependencies in CI's
    transformers 5.6.0 environment, its ceiling) at CP = 2: stock's loss, gradients and calls; past its pin, where
    stock raises (5.25 hands the layer as the partial's argument), the same error."""
    pytest.importorskip("llamafactory.model.model_utils.checkpointing",
                        reason="LLaMA-Factory 0.9.5 (`pip install --no-deps llamafactory==0.9.5`, .ci/run's 5.6.0 env)")
    _same_as_stock(run_distributed(cli_checkpointing_run, 2, "qwen3_vl", "multi_image", True, timeout=600))


def test_the_choice_is_logged_at_the_first_forward_then_at_most_once_per_hundred_with_the_changes(settings_back):
    """Rows of alternating lengths change the choice at every forward: one line at the first, then one per
    `LOG_EVERY` forwards, counting the changes since the last; a choice that stays logs nothing more (issue 65)."""
    from vlmcp_patch.by_need import LOG_EVERY, ChoiceLog
    from vlmcp_patch.switches import Switches

    log, sets = ChoiceLog(), [Switches(), Switches(mlp=True)]
    notes = [(i, log.note(sets[i % 2])) for i in range(2 * LOG_EVERY + 50)]
    lines = [(i, note) for i, note in notes if note is not None]
    assert [i for i, _ in lines] == [0, LOG_EVERY, 2 * LOG_EVERY], lines
    assert lines[0][1] == "" and f"{LOG_EVERY} changes of the switches in the last {LOG_EVERY} CP forwards" in lines[1][1]
    steady = [log.note(sets[0]) for _ in range(3 * LOG_EVERY)]
    assert steady.count(None) == len(steady) - 1  # the one change back from the MLP tiles, once its wait is over
