"""`VLMCPCallback`: an HF Trainer callback that checks the CP setup at train start and logs CP facts."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import TrainerCallback

from .attention.heads import kv_replication
from .context import CPContext
from .distributed import data_parallel_world_size, get_cp_group
from .errors import UnsupportedSetupError
from .models import SUPPORTED_CLASSES
from .models.common import SUPPORTED_ATTENTION
from .settings import SETTINGS


@dataclass
class LayoutStats:
    """Token counts of the CP forwards since the last log (telemetry only; no forward reads it)."""

    forwards: int = 0
    slots: int = 0  # token slots per rank (batch x local slice), padding included
    padding: int = 0

    def record(self, ctx: CPContext) -> None:
        slots = ctx.batch_size * ctx.local_len
        if ctx.padding_mask is not None:
            real = int(ctx.padding_mask[:, ctx.local_slice].sum())
        else:
            real = ctx.batch_size * max(0, min(ctx.seq_len - ctx.local_slice.start, ctx.local_len))
        self.forwards += 1
        self.slots += slots
        self.padding += slots - real

    def drain(self) -> dict:
        facts = {}
        if self.forwards:
            facts = {"cp_tokens_per_rank": self.slots / self.forwards, "cp_padding": self.padding / self.slots}
        self.forwards = self.slots = self.padding = 0
        return facts


STATS = LayoutStats()


def _supported_model(model):
    for module in model.modules():  # through PEFT / DeepSpeed / DDP wrappers
        if type(module).__name__ in SUPPORTED_CLASSES:
            return module
    return None


def check_cp_setup(model) -> None:
    """Raise a clear error if `model` cannot train under the configured CP size."""
    if SETTINGS.cp_size == 1:
        return
    found = _supported_model(model)
    if found is None:
        raise UnsupportedSetupError(
            f"{type(model).__name__} cannot run under CP (VLMCP_CP_SIZE={SETTINGS.cp_size}); supported: "
            f"{', '.join(SUPPORTED_CLASSES)}"
        )
    text = found.config.get_text_config()
    if text._attn_implementation not in SUPPORTED_ATTENTION:
        raise UnsupportedSetupError(
            f"attn_implementation={text._attn_implementation!r} is not supported under CP; load the model with "
            "attn_implementation='sdpa' or 'flash_attention_2'"
        )
    kv_replication(text.num_attention_heads, text.num_key_value_heads, SETTINGS.cp_size, "softmax attention")
    if getattr(text, "linear_num_value_heads", None):
        kv_replication(
            text.linear_num_value_heads, text.linear_num_key_heads, SETTINGS.cp_size, "gated DeltaNet", ("value", "key")
        )
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
