"""Image placeholder tokens on padding (issue 64), run inside the spawned ranks: LLaMA-Factory's collator gives a
batch without images a fake image whose tokens are padding (`attention_mask` 0, no labels), so that data-parallel
wrappers see the vision tower used. Stock fills every placeholder, padding included, where a feature reaches no loss;
under CP such a feature goes to no rank. Each case against stock at P=1 (`parity.compare`)."""

from __future__ import annotations

from vlmcp_patch.fixtures.data import Segment as S
from vlmcp_patch.fixtures.data import make_batch
from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_vl_config

TEXT = 9  # real tokens of the row that carries the fake image


def _with_a_fake_image(layout: list, row: int) -> dict:
    """`layout`'s batch with row `row`'s tokens after its first `TEXT` turned into padding (its image among them)."""
    batch = make_batch(layout, seed=3)
    batch["attention_mask"][row, TEXT:] = 0
    batch["labels"][row, TEXT:] = -100
    return batch


CASES = {
    # a batch without images: the fake image at the end of its first row, all of it padding
    "fake image alone": lambda: _with_a_fake_image([[S(text=TEXT), S(image=(16, 16))], [S(text=31)]], 0),
    # a real image in the first row, the fake one in the second (filled after the real one)
    "beside a real image": lambda: _with_a_fake_image(
        [[S(text=5), S(image=(16, 16)), S(text=6), S(image=(16, 32)), S(text=3)], [S(text=TEXT), S(image=(16, 16))]], 1),
}


def run_padding_image_cases(rank: int, world_size: int) -> dict:
    """{case: `compare`'s result} at P=`world_size`."""
    from tests.helpers.parity import compare

    return {name: compare(build_model(tiny_qwen3_vl_config(), seed=1), make(), world_size)
            for name, make in CASES.items()}
