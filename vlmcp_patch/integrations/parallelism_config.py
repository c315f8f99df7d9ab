"""Accelerate's own sequence-parallel switch, routed to this package's CP for the models it supports.

`ParallelismConfig(sp_backend="deepspeed", sp_size=P)` (in `TrainingArguments(parallelism_config=...)`
or an `Accelerator`) selects DeepSpeed's ALST/Ulysses. For Qwen3-VL and Qwen3.5 that path is wrong
or refused: its loader splits `input_ids` before the vision tower and mRoPE see them, and its
attention wrapper never reaches the DeltaNet recurrence (which is why accelerate refuses models with
linear-attention layers). For a model this package supports, the switch is taken over instead: CP
runs with P = sp_size and the sequence-parallel setting is removed from the accelerator, so neither
ALST's attention, its data-loader adapter, nor its refusal and loss path are engaged. Every other
model keeps accelerate's behaviour, the refusal included.

The take-over must happen before the first data loader is prepared (it is sharded over the W/P
replicas under CP, over all W ranks under ALST): the HF Trainer is handled when it creates its
accelerator; a plain `Accelerator` when the model is prepared (together with, or before, its loaders).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from ..errors import UnsupportedSetupError
from ..flags import BATCH_SIZED_BY_ACCELERATE, scoped
from ..patching import Patch
from ..settings import SETTINGS, enable
from ..supported import find_supported_model

logger = logging.getLogger("vlmcp_patch")


def _deepspeed_sp_size(accelerator) -> int:
    pc = getattr(accelerator, "parallelism_config", None)
    if pc is None or pc.sp_backend != "deepspeed" or not pc.sp_enabled:
        return 1
    return pc.sp_size


def take_over_sequence_parallelism(accelerator, model) -> bool:
    """If `accelerator` asks for DeepSpeed SP and `model` is one this package runs under CP, run CP instead.

    Returns whether the switch was taken over. Idempotent: a second call finds the setting removed.
    """
    sp_size = _deepspeed_sp_size(accelerator)
    if sp_size == 1 or model is None:
        return False
    found = find_supported_model(model)
    if found is None:
        return False
    if SETTINGS.cp_size not in (1, sp_size):
        raise UnsupportedSetupError(
            f"VLMCP_CP_SIZE={SETTINGS.cp_size} disagrees with ParallelismConfig(sp_size={sp_size}); both select "
            "the CP size here. Set one of them, or the same value in both."
        )
    enable(cp_size=sp_size)
    pc = accelerator.parallelism_config
    accelerator.state.parallelism_config = dataclasses.replace(pc, sp_size=1, sp_handler=None)
    logger.info(
        "vlmcp_patch: ParallelismConfig(sp_backend='deepspeed', sp_size=%d) runs as vlmcp_patch context "
        "parallelism (P=%d) for %s, instead of DeepSpeed ALST", sp_size, sp_size, type(found).__name__,
    )
    return True


def _model_among(objects):
    return next((obj for obj in objects if isinstance(obj, torch.nn.Module)), None)


def cp_prepare_deepspeed(wrapped, instance, args, kwargs):
    model = _model_among(args)
    if _deepspeed_sp_size(instance) > 1 and find_supported_model(model) is not None and instance._dataloaders:
        raise UnsupportedSetupError(
            "ParallelismConfig(sp_backend='deepspeed') runs as vlmcp_patch CP for this model, and CP needs the "
            "data loaders sharded over the data-parallel replicas: call accelerator.prepare() on the model "
            "together with, or before, the data loaders."
        )
    take_over_sequence_parallelism(instance, model)
    with scoped(BATCH_SIZED_BY_ACCELERATE, True):
        return wrapped(*args, **kwargs)


def patches() -> list[Patch]:
    return [
        Patch(
            target="accelerate.accelerator.Accelerator._prepare_deepspeed",
            wrapper=cp_prepare_deepspeed,
            reason="route ParallelismConfig(sp_backend='deepspeed') to CP for supported models prepared through a "
            "plain Accelerator (ALST would mangle multimodal batches and refuses DeltaNet layers), and mark "
            "accelerate's batch sizes as computed for all W ranks (fixed to W/P replicas in deepspeed.initialize)",
            expects=(),
            requires="accelerate",
        ),
    ]
