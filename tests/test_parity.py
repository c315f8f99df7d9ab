"""Qwen3-VL(-MoE) and Qwen3.5(-MoE) under CP equal stock transformers at P=1 (fp32, CPU, gloo)."""

from __future__ import annotations

import pytest

from tests.helpers.cases import EXCHANGES, FAMILIES, QWEN3_5_CASES, QWEN3_VL_CASES, run_cases, stock_cuts_the_row
from tests.helpers.flash_standin import stock_flash_attention_works
from tests.helpers.harness import run_distributed
from tests.helpers.parity import TOL

FLASH_CASES = ["multi_image", "padded_pair", "packed_text", "text_only", "one_kv_head"]


def parity_run(family: str, cp_size: int, attn: str):
    names = list(FAMILIES[family][1]) if attn == "sdpa" else FLASH_CASES
    return run_distributed(run_cases, cp_size, cp_size, family, names, attn, timeout=600)


def assert_parity(per_rank: list[dict], family: str, case: str, cp_size: int) -> None:
    for rank, res in enumerate(per_rank):
        m = res[case]
        where = f"{family} {case}, P={cp_size}, rank {rank}"
        assert m["loss_err"] <= TOL, where
        assert not m["logits_with_labels"], where  # the chunked loss builds no logits
        assert m["logits_shape_ok"], where
        assert m["logits_err"] <= TOL, where
        assert m["grad_err"] <= TOL, f"{where}: {m['worst_grad']}"
        assert m["missing_grads"] == [], where
        # The exchanges ran, and the gradients really are sharded: each rank alone differs from P=1.
        expected = EXCHANGES[family].get(case, EXCHANGES[family]["default"]) + m["vision_exchanges"]
        assert m["exchanges"] == expected, where
        assert not m["per_rank_grads_equal_reference"], where
    assert len({res[case]["loss"] for res in per_rank}) == 1, "loss differs between ranks"


def skip_where_stock_cuts_the_row(family: str, case: str) -> None:
    if stock_cuts_the_row(family, case):
        pytest.skip("transformers 5.2's causal mask in training cuts a row of images at each image (stock's error)")


@pytest.mark.parametrize("cp_size", [2, 4])
@pytest.mark.parametrize("case", list(QWEN3_VL_CASES))
def test_qwen3_vl(case, cp_size, once):
    skip_where_stock_cuts_the_row("qwen3_vl", case)
    assert_parity(once(parity_run, "qwen3_vl", cp_size, "sdpa"), "qwen3_vl", case, cp_size)


@pytest.mark.parametrize("cp_size", [2, 4])
@pytest.mark.parametrize("case", list(QWEN3_5_CASES))
def test_qwen3_5(case, cp_size, once):
    skip_where_stock_cuts_the_row("qwen3_5", case)
    assert_parity(once(parity_run, "qwen3_5", cp_size, "sdpa"), "qwen3_5", case, cp_size)


def test_lora_case_trains_only_adapters(once):
    m = once(parity_run, "qwen3_vl", 2, "sdpa")[0]["lora_frozen_vision"]
    assert m["num_params"] == m["trainable"] == 2 * 2 * 2  # 2 layers x (q, v) x (A, B)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("cp_size", [2, 4])
def test_awkward_cases_are_awkward(family, cp_size, once):
    per_case = once(parity_run, family, cp_size, "sdpa")[0]
    m = per_case["multi_image"]
    assert m["seq_len"] % cp_size, "length must not be a multiple of P"
    assert m["image_crosses_edge"], "an image span must cross a shard edge"
    fewer_heads = per_case["one_kv_head"]["num_kv_heads"] if family == "qwen3_vl" else \
        per_case["one_key_head"]["linear_key_heads"]
    assert fewer_heads < cp_size


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("cp_size", [2, 4])
def test_vision_data_parallelism_splits_the_work(family, cp_size, once):
    """Each rank encodes only its share of the vision patches (its own count, not everyone's); with
    VLMCP_VISION_DP=0 every rank encodes all of them (and parity holds either way, above)."""
    per_rank = once(parity_run, family, cp_size, "sdpa")
    for case in ("multi_image", "video_and_image"):
        encoded = [res[case]["vision_patches_per_rank"] for res in per_rank]
        total = per_rank[0][case]["vision_patches"]
        assert sum(encoded) == total and max(encoded) < total, (case, encoded, total)
    if family == "qwen3_vl":
        assert all(res["vision_replicated"]["vision_patches_per_rank"] is None for res in per_rank)


@pytest.mark.parametrize("case", FLASH_CASES)
@pytest.mark.skipif(not stock_flash_attention_works(), reason="stock flash_attention_2 fails in transformers 5.6.0")
def test_flash_attention_2_plumbing(case, once):
    """The real flash_attention_2 path of transformers, with a CPU stand-in kernel in place of flash-attn."""
    per_rank = once(parity_run, "qwen3_vl", 2, "flash_attention_2")
    assert_parity(per_rank, "qwen3_vl", case, 2)
    m = per_rank[0][case]
    calls = m["flash_calls"]
    assert calls, "the flash kernel was never called"
    # Every decoder call sees the whole sequence (never one rank's slice)...
    assert all(c["edges"][-1] >= m["seq_len"] for c in calls), calls
    if case == "packed_text":
        # ...and packed samples keep their global boundaries (P=1 calls, then CP calls with the pad tail).
        assert {tuple(c["edges"]) for c in calls} == {(0, 9, 23, 29), (0, 9, 23, 29, 30)}
