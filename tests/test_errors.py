"""Bad input and unsupported setups raise a clear error on every rank, before compute; nothing hangs."""

from __future__ import annotations

import functools

import pytest

from tests.error_cases import run_error_cases
from tests.harness import run_distributed

EXPECTED = {
    "packed_inconsistent_cu_seq_lens": ("CPInputError", "does not agree with position_ids"),
    "packed_with_padding": ("CPInputError", "both attention_mask and restarting position_ids"),
    "eager_attention": ("UnsupportedSetupError", "attn_implementation='eager'"),
    "heads_not_splittable": ("UnsupportedSetupError", "3 query heads cannot be split over CP size 2"),
    "linear_heads_not_splittable": ("UnsupportedSetupError", "gated DeltaNet: 3 value heads cannot be split over CP size 2"),
    "unsupported_model": ("UnsupportedSetupError", "Qwen3VLForConditionalGeneration"),
    "text_model_called_directly": ("UnsupportedSetupError", "called directly"),
    "image_token_mismatch": ("CPInputError", "image features and image tokens do not match"),
    "left_padding": ("CPInputError", "left padding"),
    "past_key_values": ("UnsupportedSetupError", "past_key_values"),
    "logits_to_keep": ("UnsupportedSetupError", "logits_to_keep"),
    "different_batches": ("CPInputError", "different batches"),
    "cp_size_not_dividing_world": ("UnsupportedSetupError", "does not divide the world size 2"),
}


@functools.cache
def results():
    names = [*EXPECTED, "one_rank_left_padded", "use_cache_true_is_fine"]
    return run_distributed(run_error_cases, 2, names, timeout=300)


@pytest.mark.parametrize("case", list(EXPECTED))
def test_clear_error_on_every_rank(case):
    error, phrase = EXPECTED[case]
    for rank, res in enumerate(results()):
        assert res[case]["error"] == error, (rank, res[case])
        assert phrase in res[case]["message"], (rank, res[case]["message"])


def test_one_bad_rank_stops_the_whole_group():
    rank0, rank1 = (res["one_rank_left_padded"] for res in results())
    assert rank1["error"] == "CPInputError" and "left padding" in rank1["message"]
    assert rank0["error"] == "CPInputError" and "rank(s) [1]" in rank0["message"]


def test_use_cache_true_builds_no_cache_under_cp():
    for res in results():
        assert res["use_cache_true_is_fine"] == {"error": None, "past_key_values": True}


def test_group_still_works_and_generate_runs_with_cp_bypassed():
    r0, r1 = results()
    assert r0["after"] == r1["after"]
    assert r0["generated"] == r1["generated"] == 3
    assert r0["generated_equals_p1"] and r1["generated_equals_p1"]
