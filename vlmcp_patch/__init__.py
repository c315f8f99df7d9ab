"""vlmcp-patch: exact context parallelism for Hugging Face Qwen3-VL and Qwen3.5 models.

`import vlmcp_patch` installs the patches (unless `VLMCP_DISABLE=1`); `VLMCP_CP_SIZE=P` (or
`vlmcp_patch.enable(cp_size=P)`) splits each sequence over blocks of P consecutive ranks.
"""

from __future__ import annotations

from .compat import check_transformers_version

check_transformers_version()

from .attention import registry as _attention_registry  # noqa: E402
from .callback import VLMCPCallback, check_cp_setup  # noqa: E402
from .context import disabled  # noqa: E402
from .distributed import data_parallel_rank, data_parallel_world_size, get_cp_group  # noqa: E402
from .errors import CPInputError, PatchTargetError, UnsupportedSetupError, VLMCPError  # noqa: E402
from .integrations import accelerate as _accelerate  # noqa: E402
from .integrations import deepspeed as _deepspeed  # noqa: E402
from .integrations import sp_switch as _sp_switch  # noqa: E402
from .integrations import trainer as _trainer  # noqa: E402
from .integrations import trl as _trl  # noqa: E402
from .models import common as _common  # noqa: E402
from .models import qwen3_5 as _qwen3_5  # noqa: E402
from .models import qwen3_vl as _qwen3_vl  # noqa: E402
from .patching import PatchSet  # noqa: E402
from .public import gather_sequence  # noqa: E402
from .settings import SETTINGS, cp_size, enable, env_flag  # noqa: E402

__version__ = "0.1.0"

PATCHES = PatchSet()
PATCHES.add(
    _common.GENERATE_PATCH,
    *_attention_registry.patches(),
    *_qwen3_vl.patches(),
    *_qwen3_5.patches(),
    *_accelerate.patches(),
    *_deepspeed.patches(),
    *_sp_switch.patches(),
    *_trainer.patches(),
    *_trl.patches(),
)


def apply() -> None:
    """Install every patch (a no-op when they are installed). Raises `PatchTargetError` on drift."""
    PATCHES.apply()


def revert() -> None:
    """Restore the exact original objects (transformers, and accelerate / deepspeed where patched)."""
    PATCHES.revert()


def status() -> list[dict]:
    """One entry per declared patch: its dotted target, why it exists, and whether it is installed."""
    return PATCHES.status()


if not env_flag("VLMCP_DISABLE"):
    apply()

__all__ = [
    "VLMCPCallback",
    "check_cp_setup",
    "CPInputError",
    "PatchTargetError",
    "UnsupportedSetupError",
    "VLMCPError",
    "SETTINGS",
    "apply",
    "cp_size",
    "data_parallel_rank",
    "data_parallel_world_size",
    "disabled",
    "enable",
    "gather_sequence",
    "get_cp_group",
    "revert",
    "status",
]
