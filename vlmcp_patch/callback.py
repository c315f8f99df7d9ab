"""`VLMCPCallback`: an HF Trainer callback that checks the CP setup at train start and logs CP facts."""

from __future__ import annotations

from transformers import TrainerCallback

from .distributed import data_parallel_world_size, get_cp_group
from .errors import UnsupportedSetupError
from .models import SUPPORTED_CLASSES, find_supported_model
from .models.common import check_model_config
from .settings import SETTINGS
from .stats import STATS


def check_cp_setup(model) -> None:
    """Raise a clear error if `model` cannot train under the configured CP size."""
    if SETTINGS.cp_size == 1:
        return
    found = find_supported_model(model)
    if found is None:
        raise UnsupportedSetupError(
            f"{type(model).__name__} cannot run under CP (VLMCP_CP_SIZE={SETTINGS.cp_size}); supported: "
            f"{', '.join(SUPPORTED_CLASSES)}"
        )
    check_model_config(found.config.get_text_config(), SETTINGS.cp_size)
    get_cp_group()  # torch.distributed is up and P divides the world size


class VLMCPCallback(TrainerCallback):
    """Optional: `Trainer(..., callbacks=[vlmcp_patch.VLMCPCallback()])`.

    At train start it checks the model and the distributed setup against the CP size (clear errors
    before the first step); with every training log it adds the CP size, the data-parallel size, the
    mean token slots per rank per forward and the share of them that is padding — to
    `trainer.state.log_history` and to the logs that callbacks added after it (reporters) receive.
    """

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None:
            check_cp_setup(model)
        STATS.drain()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or SETTINGS.cp_size == 1 or "loss" not in logs:
            return
        facts = {"cp_size": SETTINGS.cp_size, "cp_data_parallel_size": data_parallel_world_size(), **STATS.drain()}
        logs.update(facts)  # seen by the callbacks after this one (reporters)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(facts)
