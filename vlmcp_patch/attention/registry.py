"""Registry patches: the Ulysses wrappers take the place of transformers' attention entries."""

from __future__ import annotations

from functools import partial

from ..patching import RegistryPatch
from .ulysses import ulysses_attention

ATTENTION_REGISTRY = "transformers.modeling_utils.AttentionInterface"


def patches() -> list[RegistryPatch]:
    return [
        RegistryPatch(
            registry=ATTENTION_REGISTRY,
            key=key,
            factory=partial(ulysses_attention, flavor=flavor),
            reason=f"text-decoder calls under CP exchange sequence for heads around the stock {key} kernel",
        )
        for key, flavor in (("sdpa", "sdpa"), ("flash_attention_2", "flash"))
    ]
