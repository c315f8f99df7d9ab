"""The benchmark scripts run end to end (the numbers they print are recorded in the README; targets asserted
here are the ones that hold on any machine: exchange volumes equal the formula, no padding under CP)."""

from __future__ import annotations

import json
import re
import sys

import pytest

from tests.helpers.harness import ROOT, launch

pytestmark = pytest.mark.integration  # the second tier (docs/testing.md)


def test_gpu_check_dry_run_on_cpu_with_two_ranks():
    out = launch(ROOT / "benchmarks" / "gpu_check.py", ["--dry-run"], procs=2)
    assert out.returncode == 0, out.stderr[-3000:]
    errors = [float(x) for x in re.findall(r"rel\. error ([\d.e+-]+)", out.stdout)]
    assert len(errors) >= 5 and max(errors) <= 1e-5, out.stdout
    assert "== 5. CP parity at P=2" in out.stdout and "gpu_check: done" in out.stdout
    number = r"([\d.e+-]+)"
    flags = re.search(rf"plan flags: --matmul-tflops {number} --attention-tflops {number} --nvlink-gbs {number}",
                      out.stdout)
    assert flags and all(float(v) > 0 for v in flags.groups()), out.stdout  # the units `plan` takes


def test_gpu_check_dry_run_offload_and_tiled_mlp_sections_in_one_process():
    """Sections 8, 9 and 13 (one process): the offloaded step's gradients are the same bits, the MLP really ran in
    several tiles and its gradients equal the whole MLP's, the host pool within 1.05x and its out-of-order paths
    exact."""
    out = launch(ROOT / "benchmarks" / "gpu_check.py", ["--dry-run"], launcher="python")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "== 8. checkpoint offload" in out.stdout, out.stdout
    comparisons = re.findall(r"bit-identical (True|False)", out.stdout)  # with against without, then two controls
    assert comparisons == ["True"] * 3, out.stdout
    planned = [float(v) for v in re.findall(r"plan ([\d.]+) GiB", out.stdout)]
    assert len(planned) == 4 and all(v > 0 for v in planned), out.stdout  # section 4's two rows, section 8's two
    tiles = re.search(r"== 9\. tiled MLP.*\n  (\d+) tiles;.*input gradient rel\. error ([\d.e+-]+), worst weight "
                      r"gradient ([\d.e+-]+)", out.stdout)
    assert tiles and int(tiles.group(1)) > 1, out.stdout
    assert float(tiles.group(2)) <= 1e-5 and float(tiles.group(3)) <= 1e-5, out.stdout
    assert "host pool 0.000 GiB" not in out.stdout  # the pool held the checkpoints
    # section 13: the pool's bytes within 1.05x of what it held; the out-of-order paths exact, the pool whole after each
    ratio = re.search(r"== 13\..*\n.*: ratio ([\d.]+) \(goal <= 1\.05", out.stdout)
    assert ratio and float(ratio.group(1)) <= 1.05, out.stdout
    assert re.findall(r"same bits (True|False)", out.stdout) == ["True"] * 8, out.stdout
    assert "still given out after each path: {'raised pool': 0, 'retain pool': 0, 'two pool': 0}" in out.stdout


def test_gpu_check_reports_a_failing_section_and_runs_the_rest(monkeypatch, capsys):
    """On a lent GPU one failing section must not cost the others: it prints its traceback, the sections after it
    run, and the exit code says a section failed. `--sections` runs only those named."""
    from benchmarks import gpu_check

    def fails(setup):
        raise RuntimeError("a kernel this GPU lacks")

    monkeypatch.setattr(gpu_check, "deltanet_split", fails)
    monkeypatch.setattr(sys, "argv", ["gpu_check", "--dry-run", "--sections", "1,3,6"])
    with pytest.raises(SystemExit) as exited:
        gpu_check.main()
    out = capsys.readouterr().out
    assert exited.value.code == 1
    assert "section 3 FAILED" in out and "RuntimeError: a kernel this GPU lacks" in out, out
    assert "== 6. attained rates" in out and "sections that failed: [3]" in out, out
    assert "== 2." not in out and "== 4." not in out, out  # not asked for


def test_padding_free_rows_leave_no_padding_per_rank():
    out = launch(ROOT / "benchmarks" / "padding_per_rank.py", ["--sizes", "2", "4"], launcher="python")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = re.findall(r"\(\s*([\d.]+)%\)\s+\d+ of\s+\d+ \(\s*([\d.]+)%\)", out.stdout)
    assert len(rows) == 6 and max(float(free) for _, free in rows) <= 1.0
    assert max(float(contiguous) for contiguous, _ in rows) > 50  # what contiguous slices of the padding leave


def test_speed_dry_run_measures_runs_that_really_split_the_row():
    """The speed benchmark on the tiny models: every ratio it prints comes from runs that happened, and the CP
    runs really held 1/P of the row per rank (not a whole row each, as with CP silently off)."""
    args = ["--dry-run", "--models", "qwen3-vl", "--samples", "text-heavy", "--lengths", "64", "128", "--sizes", "2"]
    out = launch(ROOT / "benchmarks" / "speed.py", args, launcher="python")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = re.findall(r"^qwen3-vl\s+text-heavy\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)",
                      out.stdout, flags=re.MULTILINE)
    assert len(rows) == 2, out.stdout
    for row in rows:  # tokens, stock s, P=1 s, P=1 / stock, CP2 s, efficiency: all measured
        assert all(float(value) > 0 for value in row), row
    splits = re.findall(r"^split: qwen3-vl text-heavy (\d+) tokens -> CP2 ([\d.]+) per rank", out.stdout,
                        flags=re.MULTILINE)
    assert [(int(t), float(s)) for t, s in splits] == [(int(t), int(t) / 2) for t, *_ in rows], out.stdout
    assert "exponent of step time against length" in out.stdout


def test_head_benchmark_times_each_chunk_count_and_names_the_rules_choice():
    args = ["--vocab", "4096", "--hidden", "64", "--tokens", "96", "--chunks", "1", "3", "--repeats", "1"]
    out = launch(ROOT / "benchmarks" / "head.py", args, launcher="python")
    assert out.returncode == 0, out.stderr[-3000:]
    row = re.search(r"96 tokens: stock ([\d.]+) s \| 1 chunks ([\d.]+) \(64\.0x\) \| 3 chunks ([\d.]+) \(21\.3x\) \| "
                    r"the rule: (\d+) chunks of (\d+)", out.stdout)
    assert row, out.stdout
    assert float(row[1]) > 0 and float(row[2]) > 0 and float(row[3]) > 0
    assert (int(row[4]), int(row[5])) == (2, 48)  # 32x the hidden states of 96 tokens at 4096 / 64: 48 tokens


def test_memory_dry_run_really_splits_the_row_eight_ways():
    """The memory benchmark on the tiny models at P=1, 2 and 8 with gradient checkpointing: its P=8 run held an
    eighth of the row per rank, and each P printed a measured peak and ratio."""
    args = ["--dry-run", "--sizes", "1", "2", "8", "--gradient-checkpointing"]
    out = launch(ROOT / "benchmarks" / "memory.py", args, launcher="python")
    assert out.returncode == 0, out.stderr[-3000:]
    splits = {int(p): (int(local), int(total)) for p, local, total in
              re.findall(r"^split: P=(\d+) -> (\d+) tokens per rank of (\d+)", out.stdout, flags=re.MULTILINE)}
    assert set(splits) == {1, 2, 8} and splits[8] == (-(-splits[1][1] // 8), splits[1][1]), out.stdout
    rows = re.findall(r"^\s+([128])\s+([\d.]+)\s+([\d.]+)\s", out.stdout, flags=re.MULTILINE)
    assert len(rows) == 3 and all(float(peak) > 0 and float(ratio) > 0 for _, peak, ratio in rows), out.stdout


def test_ring_overlap_dry_run_times_both_schedules_on_both_layouts():
    """The ring-overlap benchmark on tiny rows, U=1 x R=4 and U=2 x R=3: every number it prints was measured (both
    schedules ran and waited for their passes)."""
    out = launch(ROOT / "benchmarks" / "ring_overlap.py", ["--dry-run"], launcher="python", timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = re.findall(r"^\s+(1x4|2x3)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(-?\d+)%\s+"
                      r"([\d.]+)\s+([\d.]+)$", out.stdout, flags=re.MULTILINE)
    assert {(layout, int(tokens)) for layout, tokens, *_ in rows} == {(u, t) for u in ("1x4", "2x3") for t in (96, 192)}
    for _, _, old, new, ratio, wait_old, _, _, busiest, work in rows:
        assert min(float(old), float(new), float(ratio), float(wait_old), float(busiest)) > 0, out.stdout
        assert 1 <= float(work) <= 1.05, out.stdout  # the zigzag chunks balance the causal work
    assert "ring_overlap: done" in out.stdout


def test_deltanet_state_dry_run_moves_the_formulas_bytes():
    """The DeltaNet state benchmark at P=3: the bytes each rank sends per layer equal the formula, forward and
    backward (one all-gather of the chunks' transfers and halos, one reduce-scatter of their gradients)."""
    out = launch(ROOT / "benchmarks" / "deltanet_state.py", ["--dry-run"], launcher="python", timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = re.findall(r"^\s*3\s+96\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)%$", out.stdout,
                      flags=re.MULTILINE)
    assert len(rows) == 1, out.stdout
    fwd, fwd_formula, bwd, bwd_formula, step, _ = map(float, rows[0])
    assert fwd == fwd_formula > 0 and bwd == bwd_formula > 0 and step > 0, out.stdout


def test_plan_measure_caches_one_measured_peak_per_run(tmp_path):
    """`benchmarks.plan_measure` (the cache `plan_check` fits on) runs the memory benchmark's own step: one record
    per (checkpointing, P), each a measured peak, P=2 holding half the row."""
    out = tmp_path / "plan_memory.json"
    args = ["--out", str(out), "--tokens", "256", "--layers", "1", "--models", "qwen3-vl", "--samples", "image-heavy",
            "--sizes", "1", "2"]
    run = launch(ROOT / "benchmarks" / "plan_measure.py", args, launcher="python")
    assert run.returncode == 0, run.stderr[-3000:]
    records = {(r["gc"], r["P"]): r for r in json.loads(out.read_text())}
    assert set(records) == {(gc, p) for gc in (False, True) for p in (1, 2)}, records
    assert all(r["peak"] > 0 for r in records.values()), records
    for gc in (False, True):
        assert records[gc, 2]["tokens_per_rank"] == records[gc, 1]["tokens_per_rank"] / 2, records


def test_plan_measure_work_runs_each_cp_row_with_the_norms_recomputed_and_kept(tmp_path):
    """`--work` (the rows the working-set constants are fitted on): checkpointing with offload and the head's chunk
    at 64 tokens; under CP each row twice, the RMSNorms recomputed and kept; P = 1 once (it never recomputes them)."""
    out = tmp_path / "plan_work.json"
    args = ["--work", "--out", str(out), "--tokens", "2048", "--layers", "1", "--models", "qwen3-vl", "--samples",
            "text-heavy", "--sizes", "1", "2"]
    run = launch(ROOT / "benchmarks" / "plan_measure.py", args, launcher="python")
    assert run.returncode == 0, run.stderr[-3000:]
    records = {(r["P"], r["recompute_norms"]): r for r in json.loads(out.read_text())}
    assert set(records) == {(1, True), (2, True), (2, False)}, records
    assert all(r["gc"] and r["offload"] and r["loss_chunk"] == 64 and r["peak"] > 0 for r in records.values())
    assert records[2, True]["peak"] < records[2, False]["peak"], records


def test_plan_measure_keeps_the_tiles_asked_for_and_skips_a_run_it_has(tmp_path):
    """With `--mlp-tile-tokens` / `--vision-tile-patches` each record names the tiles it ran with, and a second
    invocation of the same command measures nothing again (the cache's key holds the tiles)."""
    out = tmp_path / "plan_decoder.json"
    args = ["--work", "--out", str(out), "--tokens", "2048", "--layers", "1", "--models", "qwen3-vl", "--samples",
            "image-heavy", "--sizes", "2", "--norms", "recomputed", "--mlp-tile-tokens", "128",
            "--vision-tile-patches", "256"]
    for _ in range(2):
        run = launch(ROOT / "benchmarks" / "plan_measure.py", args, launcher="python")
        assert run.returncode == 0, run.stderr[-3000:]
    records = json.loads(out.read_text())
    assert len(records) == 1, records
    assert records[0]["mlp_tile_tokens"] == 128 and records[0]["vision_tile_patches"] == 256, records
