"""vlmcp-patch: exact context parallelism for Hugging Face Qwen3-VL and Qwen3.5 models.

`import vlmcp_patch` installs the patches (unless `VLMCP_DISABLE=1`); `VLMCP_CP_SIZE=P` (or
`vlmcp_patch.enable(cp_size=P)`) splits each sequence over blocks of P consecutive ranks. With CP off,
every call goes to stock transformers untouched, except a batch in the documented packed-row convention (and, when
`VLMCP_OFFLOAD_CHECKPOINTS=1` is set, checkpoints that wait in host memory: the same bytes come back).
"""

from __future__ import annotations

from .compat import UntestedVersionWarning, check_transformers_version, warn_if_untested

check_transformers_version()

from . import by_need as _by_need  # noqa: E402 (registers the choice by need with `switches`)
from . import models as _models  # noqa: E402
from .attention import flash as _flash  # noqa: E402
from .attention import registry as _attention_registry  # noqa: E402
from .distributed import (  # noqa: E402
    data_parallel_rank,
    data_parallel_world_size,
    disabled,
    gather_sequence,
    get_cp_group,
    sum_over_cp_group,
)
from .errors import (  # noqa: E402
    CollectiveError,
    CPInputError,
    PatchTargetError,
    UnsummedGradientsError,
    UnsupportedSetupError,
    VLMCPError,
)
from .forward.generate import GENERATE_PATCH  # noqa: E402
from .integrations import accelerate as _accelerate  # noqa: E402
from .integrations import cli_parallelism as _cli_parallelism  # noqa: E402
from .integrations import deepspeed as _deepspeed  # noqa: E402
from .integrations import input_grads as _input_grads  # noqa: E402
from .integrations import parallelism_config as _parallelism_config  # noqa: E402
from .integrations import placement as _placement  # noqa: E402
from .integrations import samplers as _samplers  # noqa: E402
from .integrations import trainer as _trainer  # noqa: E402
from .integrations import trl as _trl  # noqa: E402
from .integrations import trl_rl as _trl_rl  # noqa: E402
from .integrations import vision_placeholder as _vision_placeholder  # noqa: E402
from .integrations.placement import PixelShareCollator, batch_to_device  # noqa: E402
from .integrations.setup import check_cp_setup  # noqa: E402
from .logprobs import token_log_probs  # noqa: E402
from .patching import PATCHES, cp_size  # noqa: E402
from .replica_step import data_parallel_step  # noqa: E402
from .settings import SETTINGS, enable, env_flag  # noqa: E402
from .share_decode import ShareDecoding, VideoItem  # noqa: E402
from .supported import supported_class_names  # noqa: E402

__version__ = "0.2.0"

PATCHES.add(
    GENERATE_PATCH,
    *_attention_registry.patches(),
    *_flash.patches(),
    *_models.patches(),
    *_vision_placeholder.patches(),
    *_accelerate.patches(),
    *_deepspeed.patches(),
    *_input_grads.patches(),
    *_parallelism_config.patches(),
    *_placement.patches(),
    *_trainer.patches(),
    *_trl.patches(),
    *_trl_rl.patches(),
    *_samplers.patches(),
    *_cli_parallelism.patches(),
)


def apply() -> None:
    """Install every patch that verifies (a no-op when they are installed); never raises on a changed target: its
    family stays stock and refuses CP, and one `UntestedVersionWarning` names each such target."""
    if PATCHES.active:
        return
    PATCHES.apply()
    warn_if_untested(unverified=dict(PATCHES.unverified))


def revert() -> None:
    """Restore the exact original objects (transformers, and accelerate / deepspeed / trl where patched);
    every helper then reports P=1."""
    PATCHES.revert()


def status() -> list[dict]:
    """One entry per declared patch: its dotted target, why it exists, whether it is installed, the optional
    package it needs, and for a patch that re-implements or rescales upstream code the pinned source digest
    and the version range it was checked on."""
    return PATCHES.status()


def __getattr__(name: str):
    # The callback subclasses transformers' TrainerCallback, whose import pulls in accelerate: load it on use.
    if name == "VLMCPCallback":
        from .callback import VLMCPCallback

        return VLMCPCallback
    # The cost model (`plan`) serves the command line and planning scripts, not a training rank: load it on use.
    if name in ("plan", "Row", "Training"):
        from . import planning

        return getattr(planning, name)
    raise AttributeError(f"module 'vlmcp_patch' has no attribute {name!r}")


if not env_flag("VLMCP_DISABLE"):
    apply()

__all__ = [
    "VLMCPCallback",
    "check_cp_setup",
    "CollectiveError",
    "CPInputError",
    "PatchTargetError",
    "UnsummedGradientsError",
    "UnsupportedSetupError",
    "UntestedVersionWarning",
    "VLMCPError",
    "SETTINGS",
    "apply",
    "batch_to_device",
    "PixelShareCollator",
    "ShareDecoding",
    "VideoItem",
    "cp_size",
    "data_parallel_rank",
    "data_parallel_step",
    "data_parallel_world_size",
    "disabled",
    "enable",
    "gather_sequence",
    "plan",
    "Row",
    "Training",
    "get_cp_group",
    "revert",
    "status",
    "sum_over_cp_group",
    "supported_class_names",
    "token_log_probs",
]
