"""`VLMCPCallback`: an HF Trainer callback that checks the CP setup at train start and logs CP facts."""

from __future__ import annotations

from transformers import TrainerCallback

from .by_need import facts as choice_facts
from .distributed import data_parallel_world_size
from .integrations.setup import check_cp_setup
from .patching import cp_size
from .offload import HOST_CHECKPOINTS
from .stats import STATS
from .tiles import NORMS, TILES
from .vision_tiles import VISION_TILES


class VLMCPCallback(TrainerCallback):
    """Optional: `Trainer(..., callbacks=[vlmcp_patch.VLMCPCallback()])`.

    At train start it checks the model and the distributed setup against the CP size (clear errors
    before the first step); with every training log it adds the CP size, the data-parallel size, the
    mean token slots per rank per forward and the share of them that is padding, and with vision data
    parallelism the vision patches this rank encoded per pass and the imbalance (busiest rank against a
    perfect split, 1.0 = balanced), with the MLPs in tiles the tiles per tiled MLP call, with the RMSNorms
    recomputed the row tiles per norm call, with the vision tower in tiles the tiles per tiled tower call, and with
    the checkpoints in host memory the host pool's size, and the memory switches of the last CP forward (each 1 / 0:
    chosen by need or set, `by_need.py`) with their predicted peak — to `trainer.state.log_history` and to the logs
    that callbacks added after it (reporters) receive. The choice's one line (`by_need.Choice.line`) goes to the
    "vlmcp_patch" logger at the first CP forward, which the Trainer's console shows.
    """

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None:
            check_cp_setup(model)
        STATS.drain()
        TILES.drain()
        NORMS.drain()
        VISION_TILES.drain()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or cp_size() == 1 or "loss" not in logs:
            return
        facts = {"cp_size": cp_size(), "cp_data_parallel_size": data_parallel_world_size(), **STATS.drain(),
                 **TILES.facts(), **NORMS.facts(), **VISION_TILES.facts(), **HOST_CHECKPOINTS.facts(), **choice_facts()}
        logs.update(facts)  # seen by the callbacks after this one (reporters)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(facts)
