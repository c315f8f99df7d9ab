"""One module per model family: the family's classes (registered in `vlmcp_patch.supported`), its patches on
top of the shared CP forward (`vlmcp_patch.forward`), and what is specific to it (Qwen3-VL's deepstack rows,
Qwen3.5's gated DeltaNet split by heads).

Adding a family means adding one module here:

1. declare its `Family` records (model type, top-level classes, text decoder, multimodal model, vision tower)
   with `supported.register(...)` — matching, refusals and the integrations then know its classes;
2. return its patches from `patches()`: `base.family_patches(family, text_model_params, cut_family_inputs)` gives
   the top-level forward, the text decoder (cutting the family's own per-token inputs with `cut_family_inputs`)
   and the vision tower; add the patches of any layer the family re-implements under CP, each with the pinned
   digest of the upstream source and the releases it was checked on, and `family=` the family's name (a target
   that does not verify on a newer release then leaves that family stock, guarded, and no other);
3. list the module in `FAMILY_MODULES` below, and give it tiny configs in `vlmcp_patch.fixtures.models` and
   cases in `tests/helpers/cases.py`.
"""

from __future__ import annotations

from ..patching import Patch
from . import qwen3_5, qwen3_vl

FAMILY_MODULES = (qwen3_vl, qwen3_5)


def patches() -> list[Patch]:
    return [patch for module in FAMILY_MODULES for patch in module.patches()]
