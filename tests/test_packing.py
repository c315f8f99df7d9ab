"""Packed multimodal rows equal their samples run one by one, at P=1, 2 and 4; the packing collator."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.cases import EXCHANGES
from tests.harness import run_distributed
from tests.parity import TOL
from tests.packing_cases import CONFIGS, run_packing_cases
from vlmcp_patch.collator import (
    MultimodalPackingCollator,
    PackedDataset,
    pack_into_bins,
    padding_fraction_packed,
    padding_fraction_padded,
)



@functools.cache
def results(cp_size: int, cu_seq_lens: bool = False):
    return run_distributed(run_packing_cases, cp_size, list(CONFIGS), cu_seq_lens, timeout=600)


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_packed_row_equals_samples_one_by_one(family, cp_size):
    for rank, res in enumerate(results(cp_size)):
        m = res[family]
        where = f"{family}, P={cp_size}, rank {rank}"
        assert m["loss_err"] <= TOL, where
        assert m["logits_err"] <= TOL, where
        assert m["grad_err"] <= TOL, f"{where}: {m['worst_grad']}"
        assert m["missing_grads"] == [], where
        exchanges = 0 if cp_size == 1 else EXCHANGES[family.removesuffix("_moe")]["default"]
        assert m["exchanges"] == exchanges, where


@pytest.mark.parametrize("cp_size", [2, 4])
def test_shard_edges_fall_inside_samples_and_images(cp_size):
    m = results(cp_size)[0]["qwen3_vl"]
    assert m["edges_inside_samples"]
    if cp_size == 4:
        assert m["edge_inside_image"]


def test_cu_seq_lens_given_by_the_collator_are_used():
    for res in results(2, cu_seq_lens=True):
        for family, m in res.items():
            assert m["loss_err"] <= TOL and m["grad_err"] <= TOL, family


def test_collator_builds_the_flattening_convention():
    samples = [
        {"input_ids": torch.tensor([[5, 6, 7]]), "mm_token_type_ids": torch.tensor([[0, 0, 0]])},
        {"input_ids": torch.tensor([8, 9]), "mm_token_type_ids": torch.tensor([0, 0]), "labels": torch.tensor([8, 9])},
    ]
    row = MultimodalPackingCollator(return_cu_seq_lens=True)(samples)
    assert row["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert row["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert row["labels"].tolist() == [[-100, 6, 7, -100, 9]]
    assert row["cu_seq_lens_q"].tolist() == [0, 3, 5] and row["max_length_q"] == 3
    assert "attention_mask" not in row
    # Bins from a PackedDataset flatten the same way.
    assert MultimodalPackingCollator()([samples])["input_ids"].tolist() == [[5, 6, 7, 8, 9]]


def test_first_fit_decreasing_respects_the_budget():
    lengths = [700, 300, 500, 200, 900, 100, 400]
    bins = pack_into_bins(lengths, 1000)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 1000 for b in bins)
    assert len(bins) == 4  # 3100 tokens need at least 4 rows of 1000
    with pytest.raises(ValueError, match="more than the packing budget"):
        pack_into_bins([1200], 1000)
    dataset = PackedDataset([{"input_ids": torch.zeros(n)} for n in lengths], 1000)
    assert len(dataset) == 4 and sum(len(dataset[i]) for i in range(4)) == 7


def test_packing_pads_less_than_padded_batches():
    torch.manual_seed(0)
    lengths = torch.distributions.LogNormal(7.0, 0.8).sample((512,)).clamp(64, 8192).long().tolist()
    assert padding_fraction_packed(lengths, 8192) < padding_fraction_padded(lengths, 8)


@pytest.mark.parametrize("break_it", ["cu_seq_lens", "padding", "batch"])
def test_bad_packed_rows_raise_at_p1(break_it):
    import vlmcp_patch
    from vlmcp_patch.testing import Segment, build_model, make_packed_batch, tiny_qwen3_vl_config

    model = build_model(tiny_qwen3_vl_config())
    row, _ = make_packed_batch([[Segment(text=5)], [Segment(text=4), Segment(image=(16, 16))]], return_cu_seq_lens=True)
    if break_it == "cu_seq_lens":
        row["cu_seq_lens_q"] = row["cu_seq_lens_k"] = torch.tensor([0, 3, row["input_ids"].shape[1]], dtype=torch.int32)
    elif break_it == "padding":
        row["attention_mask"] = torch.ones_like(row["input_ids"])
    else:
        row = {k: torch.cat([v, v]) if k in ("input_ids", "mm_token_type_ids", "labels", "position_ids") else v
               for k, v in row.items() if not k.startswith(("cu_", "max_"))}
    with pytest.raises(vlmcp_patch.CPInputError):
        model(**row)
