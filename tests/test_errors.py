"""Everything the package cannot do exactly — and data that differs across the ranks of a group — raises a
clear error on every rank before compute, naming what to change; nothing hangs. README: "When it refuses"."""

from __future__ import annotations

import functools

import pytest

from tests.error_cases import run_error_cases, same_loss
from tests.harness import run_distributed

EXPECTED = {
    "cp_size_not_dividing_world": ("UnsupportedSetupError", "does not divide the world size 2"),
    "heads_not_splittable": ("UnsupportedSetupError", "3 query heads cannot be split over CP size 2"),
    "linear_heads_not_splittable": ("UnsupportedSetupError", "gated DeltaNet: 3 value heads cannot be split over CP"),
    "eager_attention": ("UnsupportedSetupError", "attn_implementation='eager'"),
    "flex_attention": ("UnsupportedSetupError", "attn_implementation='flex_attention'"),
    "unsupported_model": ("UnsupportedSetupError", "Qwen3VLForConditionalGeneration"),
    "text_model_called_directly": ("UnsupportedSetupError", "called directly"),
    "past_key_values": ("UnsupportedSetupError", "past_key_values"),
    "logits_to_keep": ("UnsupportedSetupError", "logits_to_keep"),
    "router_logits": ("UnsupportedSetupError", "output_router_logits"),
    "image_token_mismatch": ("CPInputError", "image features and image tokens do not match"),
    "left_padding": ("CPInputError", "left padding"),
    "labels_on_padding": ("CPInputError", "labels at padding positions"),
    "packed_with_padding": ("CPInputError", "packed samples with padding"),
    "packed_on_two_rows": ("CPInputError", "must come as one row"),
    "packed_inconsistent_cu_seq_lens": ("CPInputError", "does not agree with position_ids"),
    "vision_without_input_ids": ("CPInputError", "need input_ids and mm_token_type_ids"),
    # ranks of one group with different data: the field that differs and its likely cause
    "different_input_ids": ("CPInputError", "input_ids"),
    "rows_in_another_order": ("CPInputError", "input_ids"),
    "different_labels": ("CPInputError", "labels differ"),
    "different_attention_mask": ("CPInputError", "attention_mask"),
    "different_mm_token_type_ids": ("CPInputError", "mm_token_type_ids differ"),
    "augmented_pixels": ("CPInputError", "pixel_values differ"),
    "different_num_items_in_batch": ("CPInputError", "num_items_in_batch differ"),
    "different_weights": ("UnsupportedSetupError", "weights differ"),
    "bf16_on_one_rank": ("UnsupportedSetupError", "dtype differs"),
}
HINTS = {
    "different_input_ids": "data_parallel_rank()",
    "rows_in_another_order": "row order",
    "augmented_pixels": "augmentation",
    "different_num_items_in_batch": "data-parallel replicas",
}
RUNS = ["use_cache_true_is_fine", "subclass_of_a_supported_model", "sequence_shorter_than_p", "labels_all_ignored"]


@functools.cache
def results():
    return run_distributed(run_error_cases, 2, [*EXPECTED, "one_rank_left_padded", *RUNS], timeout=300)


@pytest.mark.parametrize("case", list(EXPECTED))
def test_clear_error_on_every_rank(case):
    error, phrase = EXPECTED[case]
    for rank, res in enumerate(results()):
        assert res[case]["error"] == error, (rank, res[case])
        assert phrase in res[case]["message"], (rank, res[case]["message"])
        assert HINTS.get(case, "") in res[case]["message"], (rank, res[case]["message"])


def test_weights_are_checked_again_after_load_state_dict():
    for res in results():
        assert res["weights_loaded_differently"]["error"] == "UnsupportedSetupError"
        assert "weights differ" in res["weights_loaded_differently"]["message"]


def test_one_bad_rank_stops_the_whole_group():
    rank0, rank1 = (res["one_rank_left_padded"] for res in results())
    assert rank1["error"] == "CPInputError" and "left padding" in rank1["message"]
    assert rank0["error"] == "CPInputError" and "rank(s) [1]" in rank0["message"]


def test_use_cache_true_builds_no_cache_under_cp():
    for res in results():
        case = res["use_cache_true_is_fine"]
        assert case["error"] is None and case["past_key_values"] is True, case
        assert same_loss(case["loss"], case["p1_loss"]), case


@pytest.mark.parametrize("case", ["subclass_of_a_supported_model", "sequence_shorter_than_p", "labels_all_ignored"])
def test_inputs_that_run_give_the_p1_loss(case):
    """A user's subclass of a supported class runs CP; a sequence shorter than P runs (the pad tail fills the
    ranks); labels all ignored give stock's NaN (0 / 0), as at P=1."""
    for res in results():
        assert res[case]["error"] is None, res[case]
        assert same_loss(res[case]["loss"], res[case]["p1_loss"]), res[case]


def test_the_group_still_works_after_every_error():
    r0, r1 = results()
    assert r0["after"] == r1["after"]
