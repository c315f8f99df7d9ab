"""Accelerate's own switches for sequence / context parallelism, routed to this package's CP for the models it
supports.

* `ParallelismConfig(sp_backend="deepspeed", sp_size=P)` selects DeepSpeed's ALST/Ulysses: its loader splits
  `input_ids` before the vision tower and mRoPE see them, and accelerate refuses models with linear-attention
  layers (Qwen3.5's DeltaNet).
* `ParallelismConfig(cp_size=P)` (`cp_backend="torch"`, FSDP2 only) selects torch's ring attention: the
  Trainer shards `input_ids`, labels and positions along the sequence before the model runs, which breaks
  image placement ("Image features and image tokens do not match") and 3D mRoPE, and accelerate refuses
  linear-attention layers too.

For a model this package supports, either switch is taken over: CP runs with that P, and the accelerator
gets a configuration without it — `sp_size=1`, or `cp_size=1` with the CP ranks folded into `dp_shard`
(parameters stay sharded over the same W ranks) — so none of ALST's or torch CP's hooks, input sharding,
loss paths or refusals engage. Every other model keeps accelerate's behaviour, its refusals included. A
backend this release does not know raises a clear error for the supported models.

The take-over happens before the accelerator's device mesh and data loaders exist: the HF Trainer's
configuration just before it creates its accelerator; a plain `Accelerator` when the model is prepared
(together with, or before, its loaders).
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

KNOWN_BACKENDS = {"sp": ("deepspeed",), "cp": ("torch",)}
# The backend of a ParallelismConfig that has no `<kind>_backend` field: Accelerate < 1.12 has `cp_size` (torch's ring
# attention) and no `cp_backend`, nor any `sp_*` field.
UNNAMED_BACKEND = {"sp": None, "cp": "torch"}


def requested_cp(pc) -> tuple[str, int] | None:
    """("sp" or "cp", P) when `pc` asks for sequence / context parallelism, else None; raises for a backend
    this release does not route."""
    if pc is None:
        return None
    for kind in ("sp", "cp"):
        size = getattr(pc, f"{kind}_size", 1) or 1
        if size > 1:
            backend = getattr(pc, f"{kind}_backend", UNNAMED_BACKEND[kind])
            if backend not in KNOWN_BACKENDS[kind]:
                raise UnsupportedSetupError(
                    f"ParallelismConfig({kind}_backend={backend!r}, {kind}_size={size}) is not routed by this "
                    f"vlmcp-patch release (it handles {kind}_backend in {KNOWN_BACKENDS[kind]}); use VLMCP_CP_SIZE "
                    f"instead, or upgrade vlmcp-patch."
                )
            return kind, size
    return None


def without_cp(pc, kind: str):
    """`pc` without its sequence / context parallelism: the CP ranks stay in the FSDP shard dimension."""
    if kind == "sp":
        return dataclasses.replace(pc, sp_size=1, sp_handler=None)
    return dataclasses.replace(pc, cp_size=1, cp_handler=None, dp_shard_size=(pc.dp_shard_size or 1) * pc.cp_size)


def _adopt(kind: str, size: int, model) -> None:
    if SETTINGS.cp_size not in (1, size):
        raise UnsupportedSetupError(
            f"VLMCP_CP_SIZE={SETTINGS.cp_size} disagrees with ParallelismConfig({kind}_size={size}); both select "
            "the CP size here. Set one of them, or the same value in both."
        )
    enable(cp_size=size)
    logger.info("vlmcp_patch: ParallelismConfig(%s_size=%d) runs as vlmcp_patch context parallelism (P=%d) for %s",
                kind, size, size, type(model).__name__)


def _configured_state():
    """accelerate's AcceleratorState when one exists already (`use_configured_state`), else None."""
    from accelerate.state import AcceleratorState

    return AcceleratorState() if AcceleratorState._shared_state else None


def _take_over_rl_config_request(trainer, supported: bool) -> bool:
    """A request a TRL RL config handed over (`integrations.trl_rl.rl_config_post_init` took it out of its
    ParallelismConfig before TRL's own refusal): CP for a supported model, TRL's refusal otherwise."""
    request = getattr(trainer.args, "vlmcp_requested_cp", None)
    if request is None:
        return False
    if not supported:
        raise UnsupportedSetupError(
            f"{type(trainer).__name__} does not support sequence-dim parallelism (parallelism_config "
            f"{request[0]}_size={request[1]}); vlmcp-patch runs it as context parallelism only for the models it "
            "supports. Set cp_size=1 and sp_size=1."
        )
    _adopt(*request, trainer.model)
    return True


def take_over_trainer_config(trainer) -> None:
    """Before the HF Trainer creates its accelerator: route its ParallelismConfig to CP for a supported model."""
    args = trainer.args
    supported = find_supported_model(trainer.model) is not None
    if _take_over_rl_config_request(trainer, supported):
        return
    request = requested_cp(args.parallelism_config) if supported else None
    if request is None:
        return
    _adopt(*request, trainer.model)
    args.parallelism_config = without_cp(args.parallelism_config, request[0])
    state = _configured_state()  # a configured state's ParallelismConfig is the one the accelerator uses
    if state is not None and requested_cp(getattr(state, "parallelism_config", None)) == request:
        state.parallelism_config = without_cp(state.parallelism_config, request[0])


def take_over_accelerator(accelerator, model) -> None:
    """When a plain Accelerator prepares a supported model: route its ParallelismConfig to CP."""
    request = requested_cp(accelerator.parallelism_config) if find_supported_model(model) is not None else None
    if request is None:
        return
    if accelerator._dataloaders:
        raise UnsupportedSetupError(
            f"ParallelismConfig({request[0]}_size={request[1]}) runs as vlmcp_patch CP for this model, and CP needs "
            "the data loaders sharded over the data-parallel replicas: call accelerator.prepare() on the model "
            "together with, or before, the data loaders."
        )
    _adopt(*request, model)
    new = without_cp(accelerator.parallelism_config, request[0])
    accelerator.state.parallelism_config = new
    if request[0] == "cp":  # the mesh was built from the CP configuration in Accelerator.__init__
        accelerator.state.device_mesh = new.get_device_mesh(accelerator.device.type)
        new._validate_accelerator(accelerator)


def _model_among(objects):
    return next((obj for obj in objects if isinstance(obj, torch.nn.Module)), None)


def cp_accelerator_prepare(wrapped, instance, args, kwargs):
    take_over_accelerator(instance, _model_among(args))
    return wrapped(*args, **kwargs)


def cp_prepare_deepspeed(wrapped, instance, args, kwargs):
    with scoped(BATCH_SIZED_BY_ACCELERATE, True):
        return wrapped(*args, **kwargs)


def patches() -> list[Patch]:
    return [
        Patch(
            target="accelerate.accelerator.Accelerator.prepare",
            wrapper=cp_accelerator_prepare,
            reason="route ParallelismConfig(sp_backend='deepspeed') / ParallelismConfig(cp_size=P) to CP for supported "
            "models prepared through a plain Accelerator (ALST and torch CP shard input_ids before the vision tower "
            "and mRoPE, and refuse DeltaNet layers)",
            expects=(),
            requires="accelerate",
        ),
        Patch(
            target="accelerate.accelerator.Accelerator._prepare_deepspeed",
            wrapper=cp_prepare_deepspeed,
            reason="mark accelerate's DeepSpeed batch sizes as computed for all W ranks (deepspeed.initialize sizes "
            "them for the W/P replicas under CP)",
            expects=(),
            requires="accelerate",
        ),
    ]
