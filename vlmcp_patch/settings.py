"""User-facing configuration, read from the environment at import and changed at run time by `enable()`.

Pure configuration: it imports nothing of the package but its errors. The CP size *in effect* (the configured one
while the package is applied, 1 when it is not) is `patching.cp_size`, next to the record of what is applied.

| variable | `enable()` keyword | default | meaning |
|---|---|---|---|
| `VLMCP_CP_SIZE` | `cp_size` | 1 | ranks per CP group (1: CP off) |
| `VLMCP_GATHER_LOGITS` | `gather_logits_with_labels` | off | forwards with labels also return the full logits |
| `VLMCP_VISION_DP` | `vision_dp` | on | under CP, each rank encodes only its share of the images |
| `VLMCP_MATCH_VISION_PASSES` | `match_vision_passes` | CP only | placeholder vision passes, replicas without images |
| `VLMCP_LOSS_CHUNK` | `loss_chunk_tokens` | auto | tokens per chunk of the chunked LM head + loss under CP |
| `VLMCP_MLP_TILE_TOKENS` | `mlp_tile_tokens` | auto | tokens per tile of the MLPs under CP (`tiles.py`; 0: off) |
| `VLMCP_RECOMPUTE_NORMS` | `recompute_norms` | on | under CP the RMSNorms keep their input only (`tiles.py`) |
| `VLMCP_VISION_TILE_PATCHES` | `vision_tile_patches` | auto | patches per tile of the vision tower under CP (`vision_tiles.py`; 0: off) |
| `VLMCP_OFFLOAD_CHECKPOINTS` | `offload_checkpoints` | off | the layers' checkpoints kept on the host (`offload.py`) |
| `VLMCP_SPLIT_ROLLOUTS` | `split_rollouts` | off | TRL's RL rollouts: each rank of a CP group generates its share |
| `VLMCP_ULYSSES_SIZE` | `ulysses_size` | auto | U of P = U x R: ranks per all-to-all subgroup, in a node |
| `VLMCP_TIMEOUT` | `timeout` | the user's | seconds a collective of the CP groups may wait before it raises |
| `VLMCP_DEBUG_COLLECTIVES` | `debug_collectives` | off | ranks compare their collectives after each forward and backward |
| `VLMCP_RING_OVERLAP` | `ring_overlap` | on | a ring's passes run behind its blocks' compute |
| `VLMCP_DISABLE` | (`revert()`) | off | nothing is patched; every helper reports P=1 |
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from .errors import UnsupportedSetupError

AUTO = "auto"  # a size the package chooses itself
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def _env_number(name: str, default, parse, what: str, example: str):
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return parse(raw)
    except ValueError:
        raise UnsupportedSetupError(f"{name}={raw!r} is not {what}; e.g. {name}={example}") from None


def env_int(name: str, default: int) -> int:
    return _env_number(name, default, int, "an integer", "2")


def env_float(name: str, default: float) -> float:
    return _env_number(name, default, float, "a number", "600")


def env_tokens(name: str, default: int | str = AUTO) -> int | str:
    """A token count from the environment, or `AUTO` (unset, or the word "auto")."""
    if os.environ.get(name, "").strip().lower() == AUTO:
        return AUTO
    return _env_number(name, default, int, "a number of tokens (or auto)", "4096")


def env_flag(name: str, default: bool | None = False) -> bool | None:
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise UnsupportedSetupError(f"{name}={raw!r}: use 1 / 0 (or true / false)")


@dataclass
class Settings:
    cp_size: int = 1
    gather_logits_with_labels: bool = False
    vision_dp: bool = True
    # None: placeholder vision passes under CP only; True: at P=1 too; False: never.
    match_vision_passes: bool | None = None
    loss_chunk_tokens: int = 0  # 0: sized automatically (loss.chunk_tokens: fp32 logits ~32x the slice's hidden states)
    # TRL's RL rollouts under CP: each rank generates its share of the group's prompts (faster, other draws).
    split_rollouts: bool = False
    # U of the P = U x R layout (0: chosen by layout.ulysses_degree, the subgroups inside a node); checked against the
    # heads and the node size before any compute.
    ulysses_size: int = 0
    # Seconds a collective of the CP groups waits for the other ranks before it raises (0: the timeout the user gave
    # the default group). Read when the groups are created.
    timeout: float = 0
    # Every rank records its CP collectives; the ranks compare them after each forward and backward
    # (collectives/communication.py).
    debug_collectives: bool = False
    # A ring's passes run behind the compute of its blocks (off: each pass waits where it starts, the schedule before
    # the overlap, which benchmarks/ring_overlap.py compares). Read by each ring attention call.
    ring_overlap: bool = True
    # Tokens per tile of the decoder and vision MLPs under CP (`tiles.py`): AUTO sizes them from the slice and the
    # MLP's widths (`tiles.tile_tokens`); 0 runs them untiled. Exact either way; CP off never tiles.
    mlp_tile_tokens: int | str = AUTO
    # Under CP the decoder's RMSNorms keep only their input for backward and are recomputed there (`tiles.py`): the
    # fp32 copies transformers' norms keep are most of a bf16 layer's working set after the MLP's. Exact either way.
    recompute_norms: bool = True
    # Patches per tile of the vision tower under CP, by items (`vision_tiles.py`): the rank's images and temporal
    # patch groups run through the whole tower in tiles of whole groups, only the merged and deepstack features kept,
    # each tile recomputed in backward. AUTO sizes them from the rank's patches and the tower's widths
    # (`vision_tiles.tile_patches`); 0 runs the tower untiled. Exact either way; CP off never tiles.
    vision_tile_patches: int | str = AUTO
    # Under CP and P=1 alike: the inputs gradient checkpointing saves for each decoder layer and vision block wait in
    # host memory between forward and backward (`offload.py`). Exact: the same values come back.
    offload_checkpoints: bool = False

    def validate(self) -> None:
        if not isinstance(self.cp_size, int) or isinstance(self.cp_size, bool) or self.cp_size < 1:
            raise UnsupportedSetupError(f"cp_size must be a positive integer, got {self.cp_size!r}")
        if not isinstance(self.loss_chunk_tokens, int) or self.loss_chunk_tokens < 0:
            raise UnsupportedSetupError(
                f"loss_chunk_tokens must be a non-negative integer, got {self.loss_chunk_tokens!r}"
            )
        if not isinstance(self.ulysses_size, int) or isinstance(self.ulysses_size, bool) or self.ulysses_size < 0:
            raise UnsupportedSetupError(
                f"ulysses_size must be a positive integer (0: automatic), got {self.ulysses_size!r}")
        for name in ("mlp_tile_tokens", "vision_tile_patches"):
            tile = getattr(self, name)
            if tile != AUTO and (not isinstance(tile, int) or isinstance(tile, bool) or tile < 0):
                raise UnsupportedSetupError(
                    f"{name} must be a non-negative integer (0: untiled) or {AUTO!r}, got {tile!r}")
        for name in ("offload_checkpoints", "recompute_norms"):
            if not isinstance(getattr(self, name), bool):
                raise UnsupportedSetupError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or self.timeout < 0:
            raise UnsupportedSetupError(f"timeout must be a number of seconds >= 0, got {self.timeout!r}")


def _from_environment() -> Settings:
    settings = Settings(
        cp_size=env_int("VLMCP_CP_SIZE", 1),
        gather_logits_with_labels=env_flag("VLMCP_GATHER_LOGITS"),
        vision_dp=env_flag("VLMCP_VISION_DP", True),
        match_vision_passes=env_flag("VLMCP_MATCH_VISION_PASSES", None),
        loss_chunk_tokens=env_int("VLMCP_LOSS_CHUNK", 0),
        split_rollouts=env_flag("VLMCP_SPLIT_ROLLOUTS"),
        ulysses_size=env_int("VLMCP_ULYSSES_SIZE", 0),
        timeout=env_float("VLMCP_TIMEOUT", 0),
        debug_collectives=env_flag("VLMCP_DEBUG_COLLECTIVES"),
        ring_overlap=env_flag("VLMCP_RING_OVERLAP", True),
        mlp_tile_tokens=env_tokens("VLMCP_MLP_TILE_TOKENS"),
        recompute_norms=env_flag("VLMCP_RECOMPUTE_NORMS", True),
        vision_tile_patches=env_tokens("VLMCP_VISION_TILE_PATCHES"),
        offload_checkpoints=env_flag("VLMCP_OFFLOAD_CHECKPOINTS"),
    )
    settings.validate()
    return settings


SETTINGS = _from_environment()


def enable(
    cp_size: int | None = None,
    *,
    gather_logits_with_labels: bool | None = None,
    vision_dp: bool | None = None,
    match_vision_passes: bool | None = None,
    loss_chunk_tokens: int | None = None,
    split_rollouts: bool | None = None,
    ulysses_size: int | None = None,
    timeout: float | None = None,
    debug_collectives: bool | None = None,
    ring_overlap: bool | None = None,
    mlp_tile_tokens: int | str | None = None,
    recompute_norms: bool | None = None,
    vision_tile_patches: int | str | None = None,
    offload_checkpoints: bool | None = None,
) -> Settings:
    """Change the settings for every following forward; arguments left out keep their value.

    `cp_size=1` turns CP off: the patched models then behave exactly like stock transformers.
    """
    given = {
        "cp_size": cp_size,
        "gather_logits_with_labels": gather_logits_with_labels,
        "vision_dp": vision_dp,
        "match_vision_passes": match_vision_passes,
        "loss_chunk_tokens": loss_chunk_tokens,
        "split_rollouts": split_rollouts,
        "ulysses_size": ulysses_size,
        "timeout": timeout,
        "debug_collectives": debug_collectives,
        "ring_overlap": ring_overlap,
        "mlp_tile_tokens": mlp_tile_tokens,
        "recompute_norms": recompute_norms,
        "vision_tile_patches": vision_tile_patches,
        "offload_checkpoints": offload_checkpoints,
    }
    new = dataclasses.replace(SETTINGS, **{k: v for k, v in given.items() if v is not None})
    new.validate()
    for f in dataclasses.fields(Settings):
        setattr(SETTINGS, f.name, getattr(new, f.name))
    return SETTINGS

