"""User-facing configuration, read from the environment at import and changed at run time by `enable()`.

Pure configuration: it imports nothing of the package but its errors. The CP size *in effect* (the configured one
while the package is applied, 1 when it is not) is `patching.cp_size`, next to the record of what is applied.

| variable | `enable()` keyword | default | meaning |
|---|---|---|---|
| `VLMCP_CP_SIZE` | `cp_size` | 1 | ranks per CP group (1: CP off) |
| `VLMCP_GATHER_LOGITS` | `gather_logits_with_labels` | off | forwards with labels also return the full logits |
| `VLMCP_VISION_DP` | `vision_dp` | on | under CP, each rank encodes only its share of the images |
| `VLMCP_HOST_PIXEL_SHARES` | `host_pixel_shares` | on | under CP, each rank's data loader keeps only its share of the pixel values (`host_pixels.py`) |
| `VLMCP_MATCH_VISION_PASSES` | `match_vision_passes` | CP only | placeholder vision passes, replicas without images |
| `VLMCP_LOSS_CHUNK` | `loss_chunk_tokens` | auto | tokens per chunk of the chunked LM head + loss under CP (auto: by need) |
| `VLMCP_MLP_TILE_TOKENS` | `mlp_tile_tokens` | auto | tokens per tile of the MLPs (`tiles.py`; auto: by need under CP; on: always, sized automatically; 0: off) |
| `VLMCP_RECOMPUTE_NORMS` | `recompute_norms` | auto | the RMSNorms keep their input only (`tiles.py`; auto: by need under CP; 1 / 0) |
| `VLMCP_VISION_TILE_PATCHES` | `vision_tile_patches` | auto | patches per tile of the vision tower (`vision_tiles.py`; auto: by need under CP; on / N: at any P; 0: off) |
| `VLMCP_DEVICE_MEMORY_GIB` | `device_memory_gib` | the device's | GiB a rank's step may use, for the choice by need (`by_need.py`; on CPU: none, no limit) |
| `VLMCP_HOST_MEMORY_GIB` | `host_memory_gib` | the node's | GiB of host memory a rank's checkpoint pool and parked vision features may take, for the choice by need (`by_need.py`; on an accelerator: the node's available memory shared by its ranks; on CPU: none, no limit) |
| `VLMCP_OFFLOAD_CHECKPOINTS` | `offload_checkpoints` | off | the layers' checkpoints kept on the host (`offload.py`) |
| `VLMCP_OFFLOAD_FEATURES` | `offload_features` | auto | under CP the vision features wait on the host between tower and decoder (`offload.park_features`; auto: by need with the checkpoint offload on; 1 / 0) |
| `VLMCP_SPLIT_ROLLOUTS` | `split_rollouts` | off | TRL's RL rollouts: each rank of a CP group generates its share |
| `VLMCP_ULYSSES_SIZE` | `ulysses_size` | auto | U of P = U x R: ranks per all-to-all subgroup, in a node |
| `VLMCP_TIMEOUT` | `timeout` | the user's | seconds a collective of the CP groups may wait before it raises |
| `VLMCP_DEBUG_COLLECTIVES` | `debug_collectives` | off | ranks compare their collectives after each forward and backward |
| `VLMCP_RING_OVERLAP` | `ring_overlap` | on | a ring's passes run behind its blocks' compute |
| `VLMCP_HEAD_CHUNKS` | `head_chunks` | 1 | under CP the softmax attention's exchange and kernel run in this many chunks of this rank's heads (`attention/head_chunks.py`; 1: unchunked) |
| `VLMCP_DISABLE` | (`revert()`) | off | nothing is patched; every helper reports P=1 |
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from .errors import UnsupportedSetupError

AUTO = "auto"  # a switch the package turns on by need under CP, sized by its own rule (`by_need.py`)
ON = "on"  # a switch on whatever the need, sized by the package's own rule
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
    """A token count from the environment, `AUTO` (unset, or the word "auto") or `ON` (the word "on")."""
    word = os.environ.get(name, "").strip().lower()
    if word in (AUTO, ON):
        return word
    return _env_number(name, default, int, "a number of tokens (or auto)", "4096")


def env_flag(name: str, default: bool | str | None = False) -> bool | str | None:
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw == AUTO and default == AUTO:
        return AUTO
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
    # Under CP, the integrations cut each batch's pixel values to this rank's share by items on the host, before the
    # forward (`forward/host_pixels.py`); off: every rank keeps the whole batch's.
    host_pixel_shares: bool = True
    # None: placeholder vision passes under CP only; True: at P=1 too; False: never.
    match_vision_passes: bool | None = None
    # 0: by need (`by_need.py`): the automatic size (loss.chunk_tokens: fp32 logits ~32x the slice's hidden states),
    # or under CP a smaller chunk where the row needs it
    loss_chunk_tokens: int = 0
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
    # Under CP the Ulysses exchange, the attention and the exchange back run one chunk of this rank's heads at a time,
    # forward and backward (`attention/head_chunks.py`): no rank holds the whole sequence's q/k/v for all its heads at
    # once. 1: unchunked (the path before it, bit for bit); N must divide each rank's query heads (checked before any
    # compute).
    head_chunks: int = 1
    # Tokens per tile of the decoder and vision MLPs (`tiles.py`): AUTO turns them on under CP when the row needs it
    # (`by_need.py`) and ON always, both sized from the slice and the MLP's widths (`tiles.tile_tokens`); N tiles of
    # N tokens, at P=1 too; 0 runs them untiled. Exact either way; the P=1 default never tiles.
    mlp_tile_tokens: int | str = AUTO
    # The decoder's RMSNorms keep only their input for backward and are recomputed there (`tiles.py`): the fp32
    # copies transformers' norms keep are most of a bf16 layer's working set after the MLP's. AUTO: under CP when
    # the row needs it (`by_need.py`); True: always, at P=1 too; False: never. Exact either way.
    recompute_norms: bool | str = AUTO
    # Patches per tile of the vision tower, by items (`vision_tiles.py`): the rank's images and temporal
    # patch groups run through the whole tower in tiles of whole groups, only the merged and deepstack features kept,
    # each tile recomputed in backward. AUTO sizes them from the rank's patches and the tower's widths
    # (`vision_tiles.tile_patches`); 0 runs the tower untiled. AUTO: under CP when the row needs it (`by_need.py`);
    # ON or N: always, at P=1 too (each call's items). Exact either way; the P=1 default never tiles.
    vision_tile_patches: int | str = AUTO
    # Under CP and P=1 alike: the inputs gradient checkpointing saves for each decoder layer and vision block wait in
    # host memory between forward and backward (`offload.py`). Exact: the same values come back.
    offload_checkpoints: bool = False
    # Under CP, the slice's vision features (merged and deepstack) wait on the host between the tower and the decoder,
    # and their gradients between the decoder and the tower (`offload.park_features`). AUTO: by need, with the
    # checkpoint offload on (`by_need.py`); True: always under CP; False: never. Exact either way (copies).
    offload_features: bool | str = AUTO
    # GiB of device memory a rank's step may use beyond what is allocated at its first CP forward, for the choice by
    # need (`by_need.py`): 0 reads the device (`torch.cuda.mem_get_info`); on a CPU, 0 sets no limit (nothing is
    # switched on by need), a number stands for a device of that much free memory (the tests drive the choice so).
    device_memory_gib: float = 0
    # The host memory a rank's checkpoint pool and parked vision features may take, for the features' choice by need:
    # 0 reads the node (`MemAvailable` shared by its local ranks, plus what this rank's pool already holds) on an
    # accelerator, and sets no limit on a CPU; a number is that many GiB (the tests drive the choice so).
    host_memory_gib: float = 0

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
        if not isinstance(self.head_chunks, int) or isinstance(self.head_chunks, bool) or self.head_chunks < 1:
            raise UnsupportedSetupError(
                f"head_chunks must be a positive integer (1: unchunked), got {self.head_chunks!r}")
        for name in ("mlp_tile_tokens", "vision_tile_patches"):
            tile = getattr(self, name)
            if tile not in (AUTO, ON) and (not isinstance(tile, int) or isinstance(tile, bool) or tile < 0):
                raise UnsupportedSetupError(
                    f"{name} must be a non-negative integer (0: untiled), {AUTO!r} or {ON!r}, got {tile!r}")
        if not isinstance(self.offload_checkpoints, bool):
            raise UnsupportedSetupError(f"offload_checkpoints must be True or False, got {self.offload_checkpoints!r}")
        for name in ("recompute_norms", "offload_features"):
            value = getattr(self, name)
            if value != AUTO and not isinstance(value, bool):
                raise UnsupportedSetupError(f"{name} must be True, False or {AUTO!r}, got {value!r}")
        for name, whose in (("device_memory_gib", "the device's"), ("host_memory_gib", "the node's")):
            memory = getattr(self, name)
            if isinstance(memory, bool) or not isinstance(memory, (int, float)) or memory < 0:
                raise UnsupportedSetupError(f"{name} must be a number of GiB >= 0 (0: {whose}), got {memory!r}")
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or self.timeout < 0:
            raise UnsupportedSetupError(f"timeout must be a number of seconds >= 0, got {self.timeout!r}")


def _from_environment() -> Settings:
    settings = Settings(
        cp_size=env_int("VLMCP_CP_SIZE", 1),
        gather_logits_with_labels=env_flag("VLMCP_GATHER_LOGITS"),
        vision_dp=env_flag("VLMCP_VISION_DP", True),
        host_pixel_shares=env_flag("VLMCP_HOST_PIXEL_SHARES", True),
        match_vision_passes=env_flag("VLMCP_MATCH_VISION_PASSES", None),
        loss_chunk_tokens=env_int("VLMCP_LOSS_CHUNK", 0),
        split_rollouts=env_flag("VLMCP_SPLIT_ROLLOUTS"),
        ulysses_size=env_int("VLMCP_ULYSSES_SIZE", 0),
        timeout=env_float("VLMCP_TIMEOUT", 0),
        debug_collectives=env_flag("VLMCP_DEBUG_COLLECTIVES"),
        ring_overlap=env_flag("VLMCP_RING_OVERLAP", True),
        head_chunks=env_int("VLMCP_HEAD_CHUNKS", 1),
        mlp_tile_tokens=env_tokens("VLMCP_MLP_TILE_TOKENS"),
        recompute_norms=env_flag("VLMCP_RECOMPUTE_NORMS", AUTO),
        vision_tile_patches=env_tokens("VLMCP_VISION_TILE_PATCHES"),
        offload_checkpoints=env_flag("VLMCP_OFFLOAD_CHECKPOINTS"),
        offload_features=env_flag("VLMCP_OFFLOAD_FEATURES", AUTO),
        device_memory_gib=env_float("VLMCP_DEVICE_MEMORY_GIB", 0),
        host_memory_gib=env_float("VLMCP_HOST_MEMORY_GIB", 0),
    )
    settings.validate()
    return settings


SETTINGS = _from_environment()


def enable(
    cp_size: int | None = None,
    *,
    gather_logits_with_labels: bool | None = None,
    vision_dp: bool | None = None,
    host_pixel_shares: bool | None = None,
    match_vision_passes: bool | None = None,
    loss_chunk_tokens: int | None = None,
    split_rollouts: bool | None = None,
    ulysses_size: int | None = None,
    timeout: float | None = None,
    debug_collectives: bool | None = None,
    ring_overlap: bool | None = None,
    head_chunks: int | None = None,
    mlp_tile_tokens: int | str | None = None,
    recompute_norms: bool | str | None = None,
    vision_tile_patches: int | str | None = None,
    offload_checkpoints: bool | None = None,
    offload_features: bool | str | None = None,
    device_memory_gib: float | None = None,
    host_memory_gib: float | None = None,
) -> Settings:
    """Change the settings for every following forward; arguments left out keep their value.

    `cp_size=1` turns CP off: the patched models then behave exactly like stock transformers.
    """
    given = {
        "cp_size": cp_size,
        "gather_logits_with_labels": gather_logits_with_labels,
        "vision_dp": vision_dp,
        "host_pixel_shares": host_pixel_shares,
        "match_vision_passes": match_vision_passes,
        "loss_chunk_tokens": loss_chunk_tokens,
        "split_rollouts": split_rollouts,
        "ulysses_size": ulysses_size,
        "timeout": timeout,
        "debug_collectives": debug_collectives,
        "ring_overlap": ring_overlap,
        "head_chunks": head_chunks,
        "mlp_tile_tokens": mlp_tile_tokens,
        "recompute_norms": recompute_norms,
        "vision_tile_patches": vision_tile_patches,
        "offload_checkpoints": offload_checkpoints,
        "offload_features": offload_features,
        "device_memory_gib": device_memory_gib,
        "host_memory_gib": host_memory_gib,
    }
    new = dataclasses.replace(SETTINGS, **{k: v for k, v in given.items() if v is not None})
    new.validate()
    for f in dataclasses.fields(Settings):
        setattr(SETTINGS, f.name, getattr(new, f.name))
    return SETTINGS

