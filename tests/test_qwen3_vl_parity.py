"""Qwen3-VL / Qwen3-VL-MoE under CP equal stock transformers at P=1 (fp32, CPU, gloo)."""

from __future__ import annotations

import functools

import pytest

from tests.cases import EXCHANGES, QWEN3_VL_CASES, run_cases
from tests.harness import run_distributed

TOL = 1e-5
FLASH_CASES = ["multi_image", "padded_pair", "packed_text", "text_only", "one_kv_head"]


@functools.cache
def results(cp_size: int, attn: str):
    names = list(QWEN3_VL_CASES) if attn == "sdpa" else FLASH_CASES
    return run_distributed(run_cases, cp_size, cp_size, names, attn, timeout=600)


def assert_parity(per_rank: list[dict], case: str, cp_size: int) -> None:
    for rank, res in enumerate(per_rank):
        m = res[case]
        where = f"{case}, P={cp_size}, rank {rank}"
        assert m["loss_err"] <= TOL, where
        assert m["local_logits_err"] <= TOL, where
        assert m["logits_shape_ok"], where
        assert m["logits_err"] <= TOL, where
        assert m["grad_err"] <= TOL, f"{where}: {m['worst_grad']}"
        assert m["missing_grads"] == [], where
        # The exchange ran, and the gradients really are sharded: each rank alone differs from P=1.
        assert m["exchanges"] == EXCHANGES.get(case, EXCHANGES["default"]), where
        assert not m["per_rank_grads_equal_reference"], where
    assert len({res[case]["loss"] for res in per_rank}) == 1, "loss differs between ranks"


@pytest.mark.parametrize("cp_size", [2, 4])
@pytest.mark.parametrize("case", list(QWEN3_VL_CASES))
def test_sdpa_parity(case, cp_size):
    assert_parity(results(cp_size, "sdpa"), case, cp_size)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_awkward_cases_are_awkward(cp_size):
    m = results(cp_size, "sdpa")[0]["multi_image"]
    assert m["seq_len"] % cp_size, "length must not be a multiple of P"
    assert m["image_crosses_edge"], "an image span must cross a shard edge"
    assert QWEN3_VL_CASES["one_kv_head"][0]["num_key_value_heads"] < cp_size


@pytest.mark.parametrize("case", FLASH_CASES)
def test_flash_attention_2_plumbing(case):
    """The real flash_attention_2 path of transformers, with a CPU stand-in kernel in place of flash-attn."""
    per_rank = results(2, "flash_attention_2")
    assert_parity(per_rank, case, 2)
    m = per_rank[0][case]
    calls = m["flash_calls"]
    assert calls, "the flash kernel was never called"
    # Every decoder call sees the whole sequence (never one rank's slice)...
    assert all(c["edges"][-1] >= m["seq_len"] for c in calls), calls
    if case == "packed_text":
        # ...and packed samples keep their global boundaries (P=1 calls, then CP calls with the pad tail).
        assert {tuple(c["edges"]) for c in calls} == {(0, 9, 23, 29), (0, 9, 23, 29, 30)}
