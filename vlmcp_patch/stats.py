"""Token counts of the CP forwards and ZeRO-3 placeholder vision passes, for `VLMCPCallback`'s logs (telemetry)."""

from __future__ import annotations

from dataclasses import dataclass

from .context import CPContext


@dataclass
class LayoutStats:
    """Token counts of the CP forwards since the last log (telemetry only; no forward reads it)."""

    forwards: int = 0
    slots: int = 0  # token slots per rank (batch x local slice), padding included
    padding: int = 0
    vision_placeholders: int = 0  # ZeRO-3 placeholder vision passes (models/vision_placeholder.py)

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
        if self.vision_placeholders:
            facts["cp_vision_placeholder_passes"] = self.vision_placeholders
        self.forwards = self.slots = self.padding = self.vision_placeholders = 0
        return facts


STATS = LayoutStats()
