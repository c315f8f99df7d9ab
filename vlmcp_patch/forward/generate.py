"""`generate()` runs with CP bypassed: each rank decodes alone, exactly as at P=1."""

from __future__ import annotations

from ..distributed import cp_requested, disabled
from ..patching import Patch


def cp_bypassed_generate(wrapped, instance, args, kwargs):
    # Incremental decoding keeps a cache per rank and feeds one token at a time: nothing to split.
    if not cp_requested():
        return wrapped(*args, **kwargs)
    with disabled():
        return wrapped(*args, **kwargs)


GENERATE_PATCH = Patch(
    target="transformers.generation.utils.GenerationMixin.generate",
    wrapper=cp_bypassed_generate,
    reason="under CP: generation runs with CP bypassed (each rank decodes alone, as at P=1)",
    expects=("inputs", "generation_config"),
)
