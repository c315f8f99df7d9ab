"""One module per model family: its patches on top of the shared CP forward (`vlmcp_patch.forward`), and
what is specific to it (Qwen3-VL's deepstack rows, Qwen3.5's gated DeltaNet split by heads). The families
themselves are declared in `vlmcp_patch.supported`."""

from __future__ import annotations

from ..patching import Patch
from . import qwen3_5, qwen3_vl


def patches() -> list[Patch]:
    return [*qwen3_vl.patches(), *qwen3_5.patches()]
