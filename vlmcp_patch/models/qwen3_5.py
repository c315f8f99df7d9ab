"""Qwen3.5 and Qwen3.5-MoE: the shared CP forward, plus the gated DeltaNet layers split by heads."""

from __future__ import annotations

from ..attention.linear import gated_deltanet_over_cp
from ..context import CTX_KWARG
from ..patching import Patch
from . import vision_placeholder
from .common import call_arguments, family_patches

FAMILIES = {
    "qwen3_5": ("Qwen3_5", ["Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"]),
    "qwen3_5_moe": ("Qwen3_5Moe", ["Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"]),
}
TEXT_MODEL_PARAMS = ("input_ids", "inputs_embeds", "position_ids", "attention_mask", "use_cache")
# Digest of the upstream Qwen3_5GatedDeltaNet.forward that `gated_deltanet_over_cp` re-implements
# (identical in the MoE module). A different digest means upstream changed the layer: re-check it.
GATED_DELTANET_FORWARD = "8f31ae7d35daf534"


def cp_gated_deltanet_forward(wrapped, instance, args, kwargs):
    if kwargs.get(CTX_KWARG) is None:
        return wrapped(*args, **kwargs)
    call = call_arguments(wrapped, args, kwargs)
    return gated_deltanet_over_cp(instance, call["hidden_states"], call[CTX_KWARG])


def patches() -> list[Patch]:
    out = []
    for module, (prefix, tops) in FAMILIES.items():
        path = f"transformers.models.{module}.modeling_{module}"
        out += family_patches(path, tops, f"{prefix}TextModel", TEXT_MODEL_PARAMS)
        out += vision_placeholder.patches(path, f"{prefix}Model")
        out.append(
            Patch(
                target=f"{path}.{prefix}GatedDeltaNet.forward",
                wrapper=cp_gated_deltanet_forward,
                reason="under CP: exchange sequence for heads so the causal conv and the delta-rule recurrence "
                "see the whole sequence (reset per packed sample) for this rank's heads",
                expects=("hidden_states", "cache_params", "attention_mask"),
                mirrors=GATED_DELTANET_FORWARD,
            )
        )
    return out
