"""Packed multimodal rows equal their samples run one by one, at P=1, 2 and 4; the packing collator."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.cases import EXCHANGES
from tests.helpers.harness import run_distributed
from tests.helpers.packing_cases import CONFIGS, run_packing_cases
from tests.helpers.parity import TOL
from vlmcp_patch.collator import MultimodalPackingCollator, PackedDataset, pack_into_bins


def packing_run(cp_size: int, cu_seq_lens: bool = False):
    return run_distributed(run_packing_cases, cp_size, list(CONFIGS), cu_seq_lens, timeout=600)


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_packed_row_equals_samples_one_by_one(family, cp_size, once):
    for rank, res in enumerate(once(packing_run, cp_size)):
        m = res[family]
        where = f"{family}, P={cp_size}, rank {rank}"
        assert m["loss_err"] <= TOL, where
        assert m["logits_err"] <= TOL, where
        assert m["grad_err"] <= TOL, f"{where}: {m['worst_grad']}"
        assert m["missing_grads"] == [], where
        exchanges = 0 if cp_size == 1 else EXCHANGES[family.removesuffix("_moe")]["default"] + m["vision_exchanges"]
        assert m["exchanges"] == exchanges, where


@pytest.mark.parametrize("cp_size", [2, 4])
def test_shard_edges_fall_inside_samples_and_images(cp_size, once):
    m = once(packing_run, cp_size)[0]["qwen3_vl"]
    assert m["edges_inside_samples"]
    if cp_size == 4:
        assert m["edge_inside_image"]


def test_cu_seq_lens_given_by_the_collator_are_used(once):
    for res in once(packing_run, 2, True):
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


def _packed_row():
    from vlmcp_patch.fixtures.data import Segment, make_packed_batch

    row, _ = make_packed_batch([[Segment(text=5)], [Segment(text=4), Segment(image=(16, 16))]], return_cu_seq_lens=True)
    return row


def test_a_packed_row_without_token_types_where_the_release_reads_the_placeholders():
    """A release whose models take no `mm_token_type_ids` (5.2: `get_rope_index` finds the images from the
    placeholder tokens) takes a packed multimodal row without them: the same loss and logits as with them. (Where the
    models take them, stock refuses a multimodal row without them, and so does the package: its error propagates.)"""
    import inspect

    from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_vl_config

    model = build_model(tiny_qwen3_vl_config())
    if "mm_token_type_ids" in inspect.signature(model.model.get_rope_index).parameters:
        pytest.skip("this release's models take mm_token_type_ids (stock refuses images without them)")
    row = _packed_row()
    for inputs in (row, {k: v for k, v in row.items() if k != "labels"}):  # the loss; the logits (no labels)
        with_types = model(**inputs)
        without = model(**{k: v for k, v in inputs.items() if k != "mm_token_type_ids"})
        key = "loss" if "labels" in inputs else "logits"
        assert torch.equal(with_types[key], without[key]), key


def test_inconsistent_packed_row_raises_at_p1():
    import vlmcp_patch
    from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_vl_config

    row = _packed_row()
    row["cu_seq_lens_q"] = row["cu_seq_lens_k"] = torch.tensor([0, 3, row["input_ids"].shape[1]], dtype=torch.int32)
    with pytest.raises(vlmcp_patch.CPInputError, match="does not agree with position_ids"):
        build_model(tiny_qwen3_vl_config())(**row)


@pytest.mark.parametrize("variant", ["with_attention_mask", "two_rows"])
def test_rows_outside_the_packing_convention_run_stock_at_p1(variant):
    """At P=1 only the documented convention takes the package's path: the same restarting positions with an
    attention_mask, or on two rows, go to stock transformers untouched (bit-identical)."""
    import vlmcp_patch
    from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_vl_config

    row = {k: v for k, v in _packed_row().items() if not k.startswith(("cu_", "max_"))}
    if variant == "with_attention_mask":
        row["attention_mask"] = torch.ones_like(row["input_ids"])
    else:
        row = {k: torch.cat([v, v]) if k in ("input_ids", "mm_token_type_ids", "labels", "position_ids") else v
               for k, v in row.items()}
        row["pixel_values"] = torch.cat([row["pixel_values"]] * 2)
        row["image_grid_thw"] = torch.cat([row["image_grid_thw"]] * 2)
    model = build_model(tiny_qwen3_vl_config())
    ours = model(**row)
    vlmcp_patch.revert()
    try:
        stock = model(**row)
    finally:
        vlmcp_patch.apply()
    assert torch.equal(ours.loss, stock.loss) and torch.equal(ours.logits, stock.logits)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_a_packed_row_stock_gets_wrong_equals_its_samples_at_p1(family, attn, reapply):
    """Pictures with text positions, or DeltaNet layers: stock runs such a row across its samples; the package's P=1
    path equals the samples run one by one — with eager attention too (a block-causal mask)."""
    import vlmcp_patch
    from tests.helpers.packing_cases import PACKED, sample_alone
    from vlmcp_patch.fixtures.compare import rel_err
    from vlmcp_patch.fixtures.data import make_packed_batch
    from vlmcp_patch.fixtures.models import build_model

    config = CONFIGS[family]()
    config._attn_implementation = config.get_text_config()._attn_implementation = attn
    model = build_model(config, seed=1)
    row, alone = make_packed_batch(PACKED, seed=3)
    without_labels = lambda batch: {k: v for k, v in batch.items() if k != "labels"}  # noqa: E731
    with torch.no_grad():
        ours = model(**without_labels(row)).logits
        vlmcp_patch.revert()
        separate = torch.cat([model(**sample_alone(b), use_cache=False).logits for b in alone], dim=1)
        stock = model(**without_labels(row)).logits
    assert rel_err(ours, separate) <= TOL
    assert rel_err(stock, separate) > 1e-2  # the control: stock itself does not


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_packed_row_stock_gets_right_runs_stock_at_p1(attn, reapply):
    """Text samples packed in the flattening convention without a KV cache: stock attends within each sample, so
    the row runs stock at P=1, bit for bit (transformers' own padding-free tests run such rows)."""
    import vlmcp_patch
    from tests.helpers.cases import packed_text_batch
    from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_vl_config

    model = build_model(tiny_qwen3_vl_config(attn_implementation=attn), seed=1)
    row = packed_text_batch([9, 14, 6], seed=2)
    ours = model(**row)
    vlmcp_patch.revert()
    stock = model(**row)
    assert torch.equal(ours.loss, stock.loss) and torch.equal(ours.logits, stock.logits)


def _restarts_computed(run) -> int:
    """How many times the package computes where a batch's text positions restart (`layout.starts_of`, a host sync
    on a GPU) while `run()` runs."""
    from vlmcp_patch.forward import batch

    computed, original = [], batch.starts_of

    def counted(positions):
        computed.append(positions.shape)
        return original(positions)

    batch.starts_of = counted
    try:
        run()
    finally:
        batch.starts_of = original
    return len(computed)


@pytest.mark.parametrize("family, attn", [("qwen3_vl", "sdpa"), ("qwen3_vl", "eager"), ("qwen3_5", "sdpa")])
def test_a_packed_row_is_read_once_per_forward_at_p1(family, attn):
    """The restarts of a packed row are computed once per forward, whether the row then runs stock (text samples,
    no cache: stock gets it right) or the package's P=1 path (DeltaNet layers)."""
    from tests.helpers.cases import packed_text_batch
    from vlmcp_patch.fixtures.models import build_model

    config = CONFIGS[family]()
    config._attn_implementation = config.get_text_config()._attn_implementation = attn
    model = build_model(config, seed=1)
    row = packed_text_batch([9, 14, 6], seed=2)
    assert _restarts_computed(lambda: model(**row)) == 1


def read_once_under_cp(rank: int, world_size: int) -> list[int]:
    import vlmcp_patch
    from tests.helpers.cases import packed_text_batch
    from vlmcp_patch.fixtures.models import build_model

    vlmcp_patch.enable(cp_size=world_size)
    counts = []
    for family in ("qwen3_vl", "qwen3_5"):
        model = build_model(CONFIGS[family](), seed=1)
        row = packed_text_batch([9, 14, 6], seed=2)
        counts.append(_restarts_computed(lambda: model(**row).loss.backward()))
    return counts


def test_a_packed_row_is_read_once_per_forward_under_cp():
    for counts in run_distributed(read_once_under_cp, 2, timeout=300):
        assert counts == [1, 1]


# A one-row batch with its lengths beside the mask (ms-swift's collator, issue 64)


def one_row_with_lengths_run(rank: int, world_size: int) -> dict:
    """ms-swift's one-row batch — an all-ones mask and `cu_seq_lens_q/k = [0, L]`, `max_length_q/k = L` — against
    stock (`compare`), and what the refusals say of lengths that cannot describe the batch, under CP."""
    import vlmcp_patch
    from tests.helpers.parity import compare
    from vlmcp_patch.fixtures.data import Segment, make_batch
    from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_vl_config

    model = build_model(tiny_qwen3_vl_config(), seed=1)
    layout = [Segment(text=5), Segment(image=(16, 24)), Segment(text=7)]
    row = make_batch([layout], seed=3)
    row["attention_mask"] = torch.ones_like(row["input_ids"])
    length = row["input_ids"].shape[1]

    def lengths(*cu, longest=None):
        cu = torch.tensor(cu, dtype=torch.int32)
        longest = int(cu.diff().max()) if longest is None else longest
        return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}

    result = compare(model, {**row, **lengths(0, length)}, world_size)
    pair = make_batch([layout, [Segment(text=9)]], seed=3)
    refused = {
        "two_rows": {**pair, **lengths(0, pair["input_ids"].shape[1])},
        "other_samples": {**row, **lengths(0, 4, length)},
        "row_split_elsewhere": {**row, **lengths(0, 2 * length)},
        "max_length": {**row, **lengths(0, length, longest=length - 1)},
    }
    messages = {}
    vlmcp_patch.enable(cp_size=world_size)
    try:
        for name, batch in refused.items():
            try:
                model(**batch)
                messages[name] = None
            except vlmcp_patch.CPInputError as error:
                messages[name] = str(error)
    finally:
        vlmcp_patch.enable(cp_size=1)
    return {**result, "refused": messages}


def test_a_one_row_batch_with_its_lengths_beside_the_mask_runs_under_cp_as_stock():
    """ms-swift's collator adds `cu_seq_lens = [0, L]` and `max_length = L` beside an all-ones mask to every one-row
    batch: under CP it runs with stock's loss, logits and gradients (it was refused as if it had several rows). Lengths
    that cannot describe the batch are refused on every rank, saying what is wrong: on two rows, other samples than
    the mask's, a row split by another sequence parallelism, a wrong longest sample."""
    for rank, m in enumerate(run_distributed(one_row_with_lengths_run, 2, timeout=600)):
        assert m["loss_err"] <= TOL and m["logits_err"] <= TOL and m["grad_err"] <= TOL, (rank, m["worst_grad"])
        assert m["missing_grads"] == [], rank
        refused = m["refused"]
        assert "but this batch has 2 rows" in refused["two_rows"], refused
        assert "does not describe this one-row batch" in refused["other_samples"], refused
        assert "another sequence parallelism" in refused["row_split_elsewhere"], refused
        assert "max_length_q=19" in refused["max_length"] and "longest" in refused["max_length"], refused
