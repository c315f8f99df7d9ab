"""The registry of model families that run under CP, and how a model is matched against them.

Each family is declared in its own module under `vlmcp_patch.models` (its classes and its patches) and
registers itself here when that module is imported; the layers below the models (attention, the shared
forward, the integrations) only read this registry. A model is supported when it is (or contains, through
PEFT / DDP / DeepSpeed / FSDP wrappers) an instance of one of the registered top-level classes, subclasses
included: their inherited forward is the patched one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Family:
    """One transformers model family: its modeling module and the classes its patches target."""

    name: str  # the transformers model type, e.g. "qwen3_vl"
    top_level: tuple[str, ...]  # the classes users build; their forward is patched
    text_model: str  # the text decoder, cut to this rank's slice
    multimodal_model: str | None = None  # holds the vision tower and places its features (None: text only)
    vision_model: str | None = None
    # What this family cannot run on the package's path (under CP, a packed row at P=1) that only it knows of (e.g.
    # layers `kernels.kernelize` replaced): the model -> a message saying how to run it, or None. Checked with the
    # batch, before compute, on every rank.
    cp_check: Callable | None = field(default=None, compare=False)

    @property
    def module(self) -> str:
        return f"transformers.models.{self.name}.modeling_{self.name}"

    def target(self, cls: str, attribute: str) -> str:
        return f"{self.module}.{cls}.{attribute}"

    def classes(self) -> list[type]:
        module = importlib.import_module(self.module)
        return [getattr(module, cls) for cls in self.top_level]


FAMILIES: list[Family] = []


def register(*families: Family) -> tuple[Family, ...]:
    """Add the families a model module declares (once each); returns them."""
    for family in families:
        if all(f.name != family.name for f in FAMILIES):
            FAMILIES.append(family)
    return families


def supported_class_names() -> list[str]:
    return [cls for family in FAMILIES for cls in family.top_level]


def supported_classes() -> tuple[type, ...]:
    return tuple(cls for family in FAMILIES for cls in family.classes())


def family_of(model) -> Family | None:
    """The registered family whose top-level classes `model` is an instance of (None: not a supported model)."""
    return next((f for f in FAMILIES if isinstance(model, tuple(f.classes()))), None)


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
