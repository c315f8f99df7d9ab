"""With CP off the import changes nothing: every input stock transformers accepts gives bit-identical
outputs and gradients (or the very same error) with the patches installed and reverted; `generate()` works
at any P for every supported class, padded on either side."""

from __future__ import annotations

import inspect

import pytest
import torch

import vlmcp_patch
from tests.helpers.harness import run_distributed
from tests.helpers.outcomes import identical, outcome
from vlmcp_patch.fixtures.data import Segment as S
from vlmcp_patch.fixtures.data import make_batch
from vlmcp_patch.fixtures.models import TINY_CONFIGS, build_model
from vlmcp_patch.forward.arguments import CACHE_KEYWORDS

MODELS = TINY_CONFIGS
PAIR = [[S(text=4), S(image=(16, 16)), S(text=3)], [S(text=6)]]


def _left(batch: dict) -> dict:
    lengths = batch["attention_mask"].sum(1)
    out = dict(batch)
    for key in ("input_ids", "mm_token_type_ids", "attention_mask", "labels"):
        if key in batch:
            out[key] = torch.stack([row.roll(int(batch[key].shape[1] - n)) for row, n in zip(batch[key], lengths)])
    return out


def _text_only(batch: dict) -> dict:
    keep = ("input_ids", "attention_mask", "labels")
    out = {k: v for k, v in batch.items() if k in keep}
    out["input_ids"] = out["input_ids"].clamp(max=100)  # no image placeholder ids left
    return out


def _cumsum_positions(batch: dict) -> dict:
    mask = batch["attention_mask"]
    return {**batch, "position_ids": (mask.long().cumsum(-1) - 1).clamp(min=0)}


def _masked_fill_positions(batch: dict) -> dict:
    mask = batch["attention_mask"]
    return {**batch, "position_ids": (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)}


def _restarting_rows_without_mask(batch: dict) -> dict:
    width = batch["input_ids"].shape[1]
    positions = torch.cat([torch.arange(width // 2), torch.arange(width - width // 2)])[None].expand(2, -1)
    return {k: v for k, v in {**batch, "position_ids": positions}.items() if k != "attention_mask"}


def _embeds(model, batch: dict) -> dict:
    out = {k: v for k, v in batch.items() if k != "input_ids"}
    out["inputs_embeds"] = model.get_input_embeddings()(batch["input_ids"]).detach()
    return out


def inputs_for(name: str, model) -> dict:
    """Stock-valid inputs: padding either side, positions given (cumsum / masked-fill style) or not, embeddings,
    several rows with restarting positions, a malformed one (stock's error must stay the same)."""
    multimodal = "ForConditionalGeneration" in name
    pair = make_batch(PAIR, seed=1) if multimodal else _text_only(make_batch(PAIR, seed=1))
    text_pair = _text_only(make_batch(PAIR, seed=2))
    cases = {
        "right_padded": pair,
        "left_padded": _left(pair),
        "right_padded_cumsum_positions": _cumsum_positions(pair),
        "left_padded_cumsum_positions": _cumsum_positions(_left(pair)),
        "left_padded_masked_fill_positions": _masked_fill_positions(_left(pair)),
        "text_rows": text_pair,
        "text_left_padded_cumsum_positions": _cumsum_positions(_left(text_pair)),
        "inputs_embeds": _embeds(model, text_pair),
        "restarting_rows_without_mask": _restarting_rows_without_mask(text_pair),
        "one_row": {k: v[:1] for k, v in text_pair.items() if k != "attention_mask"},
    }
    if multimodal:
        broken = dict(pair)
        broken["input_ids"] = pair["input_ids"].clamp(max=100)  # image features without image tokens
        cases["stock_error_image_tokens"] = broken
    return cases


@pytest.mark.parametrize("name", list(MODELS))
def test_p1_is_bit_identical_to_stock_for_stock_valid_inputs(name, reapply):
    model = build_model(MODELS[name](), seed=3)
    cases = inputs_for(name, model)
    ours = {case: outcome(model, batch) for case, batch in cases.items()}
    vlmcp_patch.revert()
    stock = {case: outcome(model, batch) for case, batch in cases.items()}
    differing = [case for case in cases if not identical(ours[case], stock[case])]
    assert not differing, differing
    rejected = {case for case, outcome in stock.items() if outcome[0] == "error"}
    expected = {"stock_error_image_tokens"} & cases.keys()  # the one malformed input, by design
    assert rejected == expected, "every other input must be one stock accepts"


def generate_cases(rank: int, world_size: int) -> dict:
    """generate() for every supported class, prompts padded left and right, under CP and at P=1."""
    results = {}
    for name, make_config in MODELS.items():
        model = build_model(make_config(), seed=3)
        multimodal = "ForConditionalGeneration" in name
        prompts = make_batch(PAIR, seed=1, labels=False)
        if not multimodal:
            prompts = _text_only(prompts)
        if not models_take_token_types():
            prompts.pop("mm_token_type_ids", None)  # transformers 5.2's generate refuses arguments its models do not take
        for side, batch in (("right", prompts), ("left", _left(prompts))):
            outs = []
            for size in (world_size, 1):
                vlmcp_patch.enable(cp_size=size)
                outs.append(model.generate(**batch, max_new_tokens=3, do_sample=False))
            results[f"{name} {side}"] = (outs[0].shape[1] - batch["input_ids"].shape[1], torch.equal(*outs))
    vlmcp_patch.enable(cp_size=1)
    return results


def generate_run():
    return run_distributed(generate_cases, 2, timeout=300)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("side", ["left", "right"])
def test_generate_under_cp_equals_p1(name, side, once):
    for res in once(generate_run):
        assert res[f"{name} {side}"] == (3, True)


def models_take_token_types() -> bool:
    """Whether the installed release's multimodal models take `mm_token_type_ids` (5.3 on)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    return "mm_token_type_ids" in inspect.signature(Qwen3VLModel.forward).parameters


def _with_cache(model, spelling: str):
    """Logits, cache length and warnings of a forward given an (empty) cache under `spelling`; or, where the forward
    raises, the error's type and message in place of the logits (transformers 5.2's Qwen3.5 takes its own cache
    class only, stock included)."""
    import warnings

    from transformers import DynamicCache

    ids = torch.randint(1, 100, (1, 6), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = DynamicCache(config=model.config.get_text_config())
        try:
            logits = model(input_ids=ids, use_cache=True, **{spelling: cache}).logits.detach()
        except Exception as exc:  # noqa: BLE001 - compared with stock's, whatever it is
            logits = (type(exc), str(exc))
    return logits, cache.get_seq_length(), sorted({str(w.message) for w in caught})


@pytest.mark.parametrize("spelling", CACHE_KEYWORDS)
@pytest.mark.parametrize("name", ["Qwen3VLForConditionalGeneration", "Qwen3_5ForCausalLM"])
def test_both_cache_spellings_behave_as_stock(name, spelling, reapply):
    """`past_key_values` and `cache` (transformers 5.24 renames the first to the second and deprecates it): the
    patched forward gives what stock gives for either spelling on the installed release, warnings included."""
    model = build_model(MODELS[name](), seed=3)
    ours = _with_cache(model, spelling)
    vlmcp_patch.revert()
    stock = _with_cache(model, spelling)
    if isinstance(stock[0], tuple):
        same_logits = ours[0] == stock[0]
    else:
        same_logits = torch.is_tensor(ours[0]) and torch.equal(ours[0], stock[0])
    assert same_logits and ours[1:] == stock[1:]
