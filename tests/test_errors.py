"""Everything the package cannot do exactly, every malformed batch, and data that differs across the ranks of a
group raise a clear error on every rank before compute, naming what to change, within seconds; inputs stock
accepts run and give the P=1 loss. docs/errors.md and docs/inputs.md."""

from __future__ import annotations

import pytest

from tests.helpers.error_cases import SCENARIOS, run_error_cases, same_loss, script_flash_boundaries_wrong_on_one_rank
from tests.helpers.harness import run_distributed

SETUPS = {
    "cp_size_not_dividing_world": ("UnsupportedSetupError", "does not divide the world size 2"),
    "ulysses_size_not_dividing_p": ("UnsupportedSetupError", "VLMCP_ULYSSES_SIZE=4 (enable(ulysses_size=...)) cannot"),
    "eager_attention": ("UnsupportedSetupError", "attn_implementation='eager'"),
    "flex_attention": ("UnsupportedSetupError", "attn_implementation='flex_attention'"),
    "unsupported_model": ("UnsupportedSetupError", "Qwen3VLForConditionalGeneration"),
    "text_model_called_directly": ("UnsupportedSetupError", "called directly"),
    "past_key_values": ("UnsupportedSetupError", "past_key_values"),
    "cache_keyword": ("UnsupportedSetupError", "past_key_values"),
    "router_logits": ("UnsupportedSetupError", "output_router_logits"),
    "four_dimensional_mask": ("UnsupportedSetupError", "4D attention_mask"),
    "deltanet_mask_with_holes": ("CPInputError", "holes"),
    "deltanet_rows_restarting": ("CPInputError", "restart inside a row"),
    "labels_on_padding": ("CPInputError", "labels at padding positions"),
    "script_attention_computing_itself": ("UnsupportedSetupError", "calls neither transformers' attention functions"),
    "script_flash_attention_bound_before_import": ("UnsupportedSetupError", "as bound before `import vlmcp_patch`"),
}
# Malformed batches: stock fails inside its compute (under CP on one rank only, the others would wait);
# here every rank raises before compute, and at P=1 stock's own error (or, for a packed row, ours) remains.
MALFORMED = {
    "image_token_mismatch": ("CPInputError", "image features and image tokens do not match"),
    "labels_outside_vocabulary": ("CPInputError", "labels hold 300, outside the vocabulary"),
    "input_ids_outside_vocabulary": ("CPInputError", "input_ids hold 128, outside the vocabulary"),
    "fewer_pixel_rows": ("CPInputError", "patch rows"),
    "extra_pixel_rows": ("CPInputError", "patch rows"),
    "zero_in_grid": ("CPInputError", "must be positive"),
    "labels_longer_without_mask": ("ValueError", "labels have shape"),
    "labels_shorter": ("ValueError", "labels have shape"),
    "labels_longer_with_mask": ("ValueError", "labels have shape"),
    "positions_longer": ("CPInputError", "position_ids have shape"),
    "packed_row_with_longer_labels": ("ValueError", "labels have shape"),
    "input_ids_and_embeds": ("ValueError", "exactly one of input_ids or inputs_embeds"),
    "packed_inconsistent_cu_seq_lens": ("CPInputError", "does not agree with position_ids"),
    "flattened_row_with_bad_lengths": ("CPInputError", "cumulative sample lengths"),
    "logits_to_keep_with_every_label": ("ValueError", "logits_to_keep keeps 1 logits"),
}
# Inputs whose fate is stock's and differs by release: transformers 5.2 finds images from their placeholder tokens and
# takes no `mm_token_type_ids`, later releases refuse images without them (docs/versions.md). What stock at P=1 refuses
# on the installed release, CP refuses with stock's own error; what it accepts runs with its loss.
AS_STOCK = {
    "vision_without_token_types_or_positions": "mm_token_type_ids",
}
DIFFERING = {
    "different_input_ids": ("CPInputError", "input_ids", "data_parallel_rank()"),
    "rows_in_another_order": ("CPInputError", "input_ids", "row order"),
    "different_labels": ("CPInputError", "labels differ", ""),
    "different_attention_mask": ("CPInputError", "attention_mask", ""),
    "different_mm_token_type_ids": ("CPInputError", "mm_token_type_ids differ", ""),
    "augmented_pixels": ("CPInputError", "pixel_values differ", "augmentation"),
    "different_num_items_in_batch": ("CPInputError", "num_items_in_batch differ", "data-parallel replicas"),
    "different_weights": ("UnsupportedSetupError", "weights differ", ""),
    "bf16_on_one_rank": ("UnsupportedSetupError", "dtype differs", ""),
    "vision_dp_off_on_one_rank": ("UnsupportedSetupError", "planned this forward differently", "VLMCP_*"),
}
RUNS = [
    "use_cache_true", "subclass_of_a_supported_model", "sequence_shorter_than_p", "labels_all_ignored", "left_padding",
    "left_padding_qwen3_5", "mask_with_holes", "packed_samples_with_padding", "packed_samples_on_two_rows",
    "four_row_positions_restarting", "vision_with_embeddings_only", "nan_in_pixel_values", "inf_in_inputs_embeds",
    "official_padded_batch", "official_flattened_row", "return_dict_false", "three_query_heads",
    "three_deltanet_value_heads", "text_after_an_image_batch", "image_tokens_on_padding",
]
SECONDS = 10  # a bad batch raises on every rank within this (the group's timeout would be minutes)


def test_every_scenario_is_checked():
    assert set(SCENARIOS) == {*SETUPS, *MALFORMED, *DIFFERING, *RUNS, *AS_STOCK, "one_rank_with_a_bad_label"}


@pytest.fixture(scope="module")
def results():
    return run_distributed(run_error_cases, 2, list(SCENARIOS), timeout=400)


@pytest.mark.parametrize("case", [*SETUPS, *MALFORMED])
def test_clear_error_on_every_rank(case, results):
    error, phrase = {**SETUPS, **MALFORMED}[case]
    for rank, res in enumerate(results):
        assert res[case]["error"] == error, (rank, res[case])
        assert phrase in res[case]["message"], (rank, res[case]["message"])
        assert res[case]["seconds"] < SECONDS, (rank, res[case])


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_batches_fail_at_p1_too(case, results):
    """At P=1 the call is stock's (or, for a packed row, the package's own path): it fails as well."""
    for res in results:
        assert res[case]["p1"]["error"] is not None, res[case]["p1"]


@pytest.mark.parametrize("case", list(AS_STOCK))
def test_what_stock_refuses_cp_refuses_alike_and_what_it_accepts_runs_with_its_loss(case, results):
    for rank, res in enumerate(results):
        cp, stock = res[case], res[case]["p1"]
        if stock["error"] is None:
            assert cp["error"] is None and same_loss(cp["loss"], stock["loss"]), (rank, res[case])
        else:
            assert AS_STOCK[case] in stock["message"], (rank, stock)
            assert (cp["error"], cp["message"]) == (stock["error"], stock["message"]), (rank, res[case])
            assert cp["seconds"] < SECONDS, (rank, cp)


@pytest.mark.parametrize("case", list(DIFFERING))
def test_ranks_with_different_data_name_the_field_and_the_cause(case, results):
    error, phrase, hint = DIFFERING[case]
    for rank, res in enumerate(results):
        assert res[case]["error"] == error, (rank, res[case])
        assert phrase in res[case]["message"] and hint in res[case]["message"], (rank, res[case]["message"])


def test_weights_are_checked_again_after_load_state_dict(results):
    for res in results:
        assert res["weights_loaded_differently"]["error"] == "UnsupportedSetupError"
        assert "weights differ" in res["weights_loaded_differently"]["message"]


def test_one_bad_rank_stops_the_whole_group(results):
    rank0, rank1 = (res["one_rank_with_a_bad_label"] for res in results)
    assert rank1["error"] == "CPInputError" and "labels hold 999" in rank1["message"]
    assert rank0["error"] == "CPInputError" and "rank(s) [1]" in rank0["message"]
    assert max(rank0["seconds"], rank1["seconds"]) < SECONDS


@pytest.mark.parametrize("case", RUNS)
def test_inputs_stock_accepts_run_with_the_p1_loss(case, results):
    """Left padding, holes, packed samples with padding or on several rows, embeddings with images, non-finite
    values, the official fine-tuning script's two formats, ...: they run under CP, with the loss of P=1 (stock,
    or the package's path for a packed row); NaN stays NaN as in stock."""
    for res in results:
        assert res[case]["error"] is None and res[case]["p1"]["error"] is None, res[case]
        assert same_loss(res[case]["loss"], res[case]["p1"]["loss"]), res[case]


def test_return_dict_false_gives_stocks_tuple(results):
    """The tuple has stock's fields at stock's positions (the logits included, gathered) — without a cache,
    which a CP forward does not build (docs/inputs.md: "The contract")."""
    for res in results:
        assert res["return_dict_false"]["tuple_len"] == res["return_dict_false"]["p1"]["tuple_len"]


def test_use_cache_true_builds_no_cache_under_cp(results):
    for res in results:
        assert res["use_cache_true"]["cache"] is False and res["use_cache_true"]["p1"]["cache"] is True


def test_the_group_still_works_after_every_error(results):
    r0, r1 = results
    assert r0["after"] == r1["after"]


def test_a_scripts_flash_boundaries_wrong_on_one_rank_raise_on_every_rank():
    """The boundaries a script hands flash-attn reach the package inside the decoder: the ranks agree on them there,
    so a rank whose script gave another row's boundaries stops every rank with the same error, not only itself."""
    per_rank = run_distributed(script_flash_boundaries_wrong_on_one_rank, 2, timeout=300)
    for rank, res in enumerate(per_rank):
        assert res["error"] == "UnsupportedSetupError", (rank, res)
        assert "do not describe the row on CP rank(s) [1]" in res["message"], (rank, res["message"])
        assert res["seconds"] < SECONDS, (rank, res)
    assert "cu_seqlens_q=" in per_rank[1]["message"] and "cu_seqlens_q=" not in per_rank[0]["message"]
