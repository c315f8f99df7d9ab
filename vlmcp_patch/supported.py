"""The model families that run under CP, declared statically, and how a model is matched against them.

Each family names the transformers modeling module and the classes its patches target. A model is
supported when it is (or contains, through PEFT / DDP / DeepSpeed / FSDP wrappers) an instance of one of
the top-level classes, subclasses included: their inherited forward is the patched one.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    top_level: tuple[str, ...]  # the classes users build; their forward is patched
    text_model: str  # the text decoder, cut to this rank's slice
    multimodal_model: str | None = None  # holds the vision tower and places its features (None: text only)
    vision_model: str | None = None

    @property
    def module(self) -> str:
        return f"transformers.models.{self.name}.modeling_{self.name}"

    def target(self, cls: str, attribute: str) -> str:
        return f"{self.module}.{cls}.{attribute}"


FAMILIES = (
    Family("qwen3_vl", ("Qwen3VLForConditionalGeneration",), "Qwen3VLTextModel", "Qwen3VLModel", "Qwen3VLVisionModel"),
    Family(
        "qwen3_vl_moe", ("Qwen3VLMoeForConditionalGeneration",), "Qwen3VLMoeTextModel", "Qwen3VLMoeModel",
        "Qwen3VLMoeVisionModel",
    ),
    Family(
        "qwen3_5", ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"), "Qwen3_5TextModel", "Qwen3_5Model",
        "Qwen3_5VisionModel",
    ),
    Family(
        "qwen3_5_moe", ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"), "Qwen3_5MoeTextModel",
        "Qwen3_5MoeModel", "Qwen3_5MoeVisionModel",
    ),
)


def supported_class_names() -> list[str]:
    return [cls for family in FAMILIES for cls in family.top_level]


def supported_classes() -> tuple[type, ...]:
    classes = []
    for family in FAMILIES:
        module = importlib.import_module(family.module)
        classes += [getattr(module, cls) for cls in family.top_level]
    return tuple(classes)


def find_supported_model(model):
    """The supported top-level model inside `model` (itself, or under PEFT / DDP / DeepSpeed / FSDP wrappers)."""
    if model is None:
        return None
    classes = supported_classes()
    return next((module for module in model.modules() if isinstance(module, classes)), None)


def unsupported_model_message(what: str, cp_size: int) -> str:
    return (
        f"{what} is not supported under CP (VLMCP_CP_SIZE={cp_size}); CP runs through the top-level classes "
        f"{', '.join(supported_class_names())} (and their subclasses). Use one of those, set VLMCP_CP_SIZE=1, "
        "or run this call inside `with vlmcp_patch.disabled():`."
    )
