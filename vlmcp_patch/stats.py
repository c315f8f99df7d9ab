"""Token and vision-patch counts of the CP forwards, the forwards that held a host cut of the pixel values, and the
tiles run (`tiles.py`, `vision_tiles.py`), for `VLMCPCallback`'s logs (telemetry: no forward reads it)."""

from __future__ import annotations

from dataclasses import dataclass

from .context import CPContext


@dataclass
class LayoutStats:
    """Counts of the CP forwards since the last log."""

    forwards: int = 0
    slots: int = 0  # token slots of this rank's slices
    padding: int = 0  # of which CP padding (the row padded to a multiple of P)
    vision_passes: int = 0
    vision_patches: int = 0  # patches this rank encoded
    vision_busiest: int = 0  # patches of the busiest rank of each pass, summed
    vision_total: int = 0  # patches of all ranks, summed
    vision_ranks: int = 1
    vision_placeholders: int = 0  # placeholder vision passes across replicas (integrations/vision_placeholder.py)
    host_pixel_shares: int = 0  # forwards whose pixel values came cut to this rank's share (forward/host_pixels.py)

    def record(self, ctx: CPContext) -> None:
        self.forwards += 1
        self.slots += ctx.local_len
        self.padding += ctx.local_pad_len

    def record_vision(self, patches_per_rank: list[int], rank: int) -> None:
        self.vision_passes += 1
        self.vision_patches += patches_per_rank[rank]
        self.vision_busiest += max(patches_per_rank)
        self.vision_total += sum(patches_per_rank)
        self.vision_ranks = len(patches_per_rank)

    def drain(self) -> dict:
        facts = {}
        if self.forwards:
            facts = {"cp_tokens_per_rank": self.slots / self.forwards, "cp_padding": self.padding / self.slots}
        if self.vision_passes:
            facts["cp_vision_patches_per_rank"] = self.vision_patches / self.vision_passes
            # busiest rank against a perfect split (1.0 = balanced)
            facts["cp_vision_imbalance"] = self.vision_busiest * self.vision_ranks / max(1, self.vision_total)
        if self.vision_placeholders:
            facts["cp_vision_placeholder_passes"] = self.vision_placeholders
        if self.host_pixel_shares:
            facts["cp_host_pixel_shares"] = self.host_pixel_shares
        fresh = LayoutStats()
        self.__dict__.update(fresh.__dict__)
        return facts


STATS = LayoutStats()


@dataclass
class TileCounts:
    """Tiled calls (of the MLPs; of the vision tower: `vision_tiles.py`) and their tiles since the last `drain`
    (telemetry; no forward reads it). `facts_key`: the name of the tiles per call in the training logs."""

    calls: int = 0
    forward_tiles: int = 0
    backward_tiles: int = 0
    facts_key: str = "cp_mlp_tiles_per_call"

    def drain(self) -> dict:
        out = {"calls": self.calls, "forward_tiles": self.forward_tiles, "backward_tiles": self.backward_tiles}
        self.calls = self.forward_tiles = self.backward_tiles = 0
        return out

    def facts(self) -> dict:
        """`VLMCPCallback`'s log entry (the tiles per tiled call since the last log; none when nothing was tiled),
        and a fresh count."""
        counts = self.drain()
        return {self.facts_key: counts["forward_tiles"] / counts["calls"]} if counts["calls"] else {}
