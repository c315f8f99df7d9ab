"""The memory switches in effect: what the settings force, what each CP forward chose by need (`by_need.py`
chooses, from the plan's price of the row), and the one line that says so.

The tiles (`tiles.py`, `vision_tiles.py`), the norms and the fused head read their switch here; the forward asks
`choose_switches` before any compute. The choice itself needs the cost model (`planning/`), a layer above the forward:
`by_need` registers it here when the package loads (`CHOOSER`), so this module stays below everything that reads it.

A forward's choice is frozen into its `CPContext` (`choice`) and read from there, never from "the last choice": it is
in effect while that forward runs (`CPContext.running` sets `under_choice`), and again while anything it built is
recomputed in backward — a layer transformers checkpointed (`checkpoints_carry_the_choice`), a tiled function
(`tiled_recompute` replays `forward_choice`). A second forward before the first one's backward therefore never changes
what the first one's recomputation runs: the same tiles, the same saved tensors (a non-reentrant checkpoint checks
them).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import types
from dataclasses import dataclass, fields

import torch.distributed as dist

from .flags import scoped
from .patching import cp_size
from .settings import AUTO, ON, SETTINGS

LOGGER = logging.getLogger("vlmcp_patch")
GIB = 2**30
# Tokens per chunk of the fused head when the row needs a smaller one than the automatic rule's (docs/memory.md: at
# 256 tokens the head's chunk no longer sets the peak)
SMALL_LOSS_CHUNK = 256
# Cheapest first: a smaller head chunk (the same FLOPs in more matmuls), the vision features on the host (four
# synchronous copies of them a step, with the checkpoint offload only: about 1e-4 of a long row's step), the RMSNorms
# recomputed (x1.415 on the norms, a few % of a step), the vision tower in tiles (one more forward of the tower without
# checkpointing, none with it: the tiles' recompute replaces the blocks'), the MLPs in tiles (x1.401 on the MLPs, most
# of a step's matmuls)
SWITCHES = ("loss_chunk", "features", "norms", "vision", "mlp")
LABELS = {"loss_chunk": "small loss chunk", "features": "features on host", "norms": "norm recompute",
          "vision": "vision tiles", "mlp": "MLP tiles"}
VARIABLES = {"loss_chunk": "VLMCP_LOSS_CHUNK", "features": "VLMCP_OFFLOAD_FEATURES", "norms": "VLMCP_RECOMPUTE_NORMS",
             "vision": "VLMCP_VISION_TILE_PATCHES", "mlp": "VLMCP_MLP_TILE_TOKENS"}


@dataclass(frozen=True)
class Switches:
    loss_chunk: bool = False
    norms: bool = False
    vision: bool = False
    mlp: bool = False
    features: bool = False  # last, so positional sets of the four tile switches keep their meaning

    def on(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name)]

    def cost(self) -> int:
        """The order of cost: each switch costs more than all cheaper ones together (`SWITCHES`)."""
        return sum(2**i for i, name in enumerate(SWITCHES) if getattr(self, name))


@dataclass(frozen=True)
class Choice:
    """What a CP forward runs with and why: the switches in effect (explicit ones included), the predicted peak of the
    step's activations (bytes, beside what was allocated before it), the agreed room (None: no limit known), the row
    and the layout priced."""

    switches: Switches
    explicit: tuple[str, ...]
    why: str
    peak: float
    room: float | None
    tokens: int
    patches: int
    size: int
    ulysses: int
    ring: int
    replicas: int
    offload: str | None = None  # who keeps the checkpoints on the host (`offload.offload_in_effect`)

    def line(self) -> str:
        """The one log line (module docstring)."""
        states = []
        for name in SWITCHES:
            if name == "features" and not (SETTINGS.offload_checkpoints or explicit(name) is not None):
                continue  # no host pool opted in, nothing set: not a switch of this run
            state = "on" if getattr(self.switches, name) else "off"
            states.append(f"{LABELS[name]} {state}{' (set)' if name in self.explicit else ''}")
        room = "no limit known" if self.room is None else f"{size_text(self.room)} free after the margin"
        replicas = f"{self.replicas} data replica{'s' if self.replicas != 1 else ''}"
        offload = f"; checkpoints on the host by {self.offload}" if self.offload else ""
        return (f"vlmcp_patch: CP on, P={self.size} (U x R = {self.ulysses} x {self.ring}), {replicas}; "
                f"{', '.join(states)}: {self.why}; predicted peak {size_text(self.peak)} ({room}); row "
                f"{self.tokens:,} tokens, {self.patches:,} patches{offload}")


class _State:
    choice: Choice | None = None  # the last CP forward's: a forward without a graph runs with it (`by_need`)
    logged: Switches | None = None  # what this process's line last said
    p1_logged: bool = False


STATE = _State()


# ---------------------------------------------------------------------------------------------------------------
# What the settings force, and what is in effect now


def explicit(name: str) -> bool | None:
    """What the settings force for switch `name`: True / False, or None (chosen by need)."""
    if name == "mlp":
        value = SETTINGS.mlp_tile_tokens
    elif name == "vision":
        value = SETTINGS.vision_tile_patches
    elif name == "norms":
        return None if SETTINGS.recompute_norms == AUTO else SETTINGS.recompute_norms
    elif name == "features":  # by need it acts only with the checkpoint offload on (`features_on_host`)
        return None if SETTINGS.offload_features == AUTO else SETTINGS.offload_features
    else:  # a chunk set by hand is the chunk: no smaller one by need
        return False if SETTINGS.loss_chunk_tokens else None
    return None if value == AUTO else value != 0


# The choice of the CP forward whose code runs now (module docstring): set while the forward runs and while what it
# built is recomputed; `_NO_FORWARD` outside both.
_NO_FORWARD = object()
_FORWARD_CHOICE: contextvars.ContextVar = contextvars.ContextVar("vlmcp_forward_choice", default=_NO_FORWARD)


def under_choice(choice: Choice | None) -> contextlib.AbstractContextManager:
    """The block runs under `choice` (a forward's; None: nothing by need). Set by `CPContext.running`, by the carried
    checkpoints and by `tiled_recompute` (around a recomputation)."""
    return scoped(_FORWARD_CHOICE, choice)


def forward_choice():
    """What `under_choice` set around the code running now, to be replayed around its recomputation
    (`replayed_choice`): a forward's choice, None, or the mark of no forward."""
    return _FORWARD_CHOICE.get()


def replayed_choice(captured) -> contextlib.AbstractContextManager:
    """The block runs under what `forward_choice` returned when the recomputed code first ran."""
    return contextlib.nullcontext() if captured is _NO_FORWARD else under_choice(captured)


def in_effect(name: str) -> bool:
    """Whether switch `name` acts now: as set, at any P; chosen by need under CP (the choice of the forward running or
    being recomputed, module docstring); off at P=1 unless set. An explicit switch acting at P=1 logs one line, once.
    Outside any CP forward and its recomputations (a layer checkpointed by other means than transformers', recomputed
    in backward; a forward inside `disabled()`): the last CP forward's choice."""
    forced = explicit(name)
    if forced is not None:
        if forced and cp_size() == 1 and name != "loss_chunk":
            _log_p1_once(name)
        return forced
    if cp_size() == 1:
        return False
    choice = choice_in_effect()
    return choice is not None and getattr(choice.switches, name)


def choice_in_effect() -> Choice | None:
    """The choice of the CP forward running or being recomputed now (module docstring); outside both, the last CP
    forward's."""
    choice = _FORWARD_CHOICE.get()
    return STATE.choice if choice is _NO_FORWARD else choice


def mlp_tiles_on() -> bool:
    return in_effect("mlp")


def norms_recompute_on() -> bool:
    return in_effect("norms")


def vision_tiles_on() -> bool:
    return in_effect("vision")


def loss_chunk_tokens(choice: Choice | None = None) -> int:
    """Tokens per chunk of the fused head: as set, else the small chunk where the row needs it (`choice`: the
    forward's; None: the one in effect now), else 0 (the automatic rule, `loss.chunk_tokens`)."""
    needed = in_effect("loss_chunk") if choice is None else choice.switches.loss_chunk
    return SETTINGS.loss_chunk_tokens or (SMALL_LOSS_CHUNK if needed else 0)


def size_setting(configured: int | str) -> int | str:
    """A tile size setting as the size rules read it: `ON` and `AUTO` both size automatically."""
    return AUTO if configured == ON else configured


def size_text(nbytes: float) -> str:
    """Bytes as GiB, or MiB below one GiB."""
    return f"{nbytes / GIB:.2f} GiB" if abs(nbytes) >= GIB else f"{nbytes / 2**20:.1f} MiB"


def _log_p1_once(name: str) -> None:
    if STATE.p1_logged or (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0):
        return
    STATE.p1_logged = True
    LOGGER.warning("vlmcp_patch: CP off (P=1); %s on as set (%s=%s)", LABELS[name], VARIABLES[name],
                   {"mlp": SETTINGS.mlp_tile_tokens, "vision": SETTINGS.vision_tile_patches,
                    "norms": 1}[name])


def checkpoints_carry_the_choice(model) -> None:
    """Every layer of `model` that transformers checkpoints (`gradient_checkpointing_enable`: its
    `_gradient_checkpointing_func`, reentrant or not) is recomputed in backward under the choice in effect when its
    forward ran (module docstring). Wraps each layer's checkpoint function once; a function set again later (checkpointing
    enabled anew) is wrapped at the next CP forward, before it runs. Called at every CP forward (`by_need`)."""
    for module in model.modules():
        checkpoint = getattr(module, "_gradient_checkpointing_func", None)
        if callable(checkpoint) and not isinstance(checkpoint, CheckpointUnderTheChoice):
            module._gradient_checkpointing_func = CheckpointUnderTheChoice(checkpoint)


class CheckpointUnderTheChoice:
    """A layer's checkpoint function that runs the checkpointed function, and its recomputation, under the choice in
    effect when the layer was called (`checkpoints_carry_the_choice`). A class, not a closure: a model holding it
    still pickles as its checkpoint function does.

    The wrapped function (transformers' `checkpoint`, or one a user or a CLI installed: LLaMA-Factory's reads
    `func.func.__self__` to find the layer) receives what transformers gives it, in the same shape (issue 64):
    transformers' partial — of the layer's bound `__call__`, or by release of its `forward` with the layer first —
    stays a partial of a method bound to the same layer (or of a function of the same name), with the same args and
    keywords (`_carrying`); only the innermost function runs the call under the captured choice. Outside any CP forward
    there is nothing to carry and the function passes through untouched."""

    def __init__(self, checkpoint):
        self.checkpoint = checkpoint
        # what `offload._saves_on_cpu` reads of a checkpoint function (a partial's `func`): the wrapped one's
        self.func = getattr(checkpoint, "func", checkpoint)

    def __call__(self, function, *args, **kwargs):
        return self.checkpoint(_carrying(forward_choice(), function), *args, **kwargs)


def _carrying(captured, function):
    """`function` that runs under `captured` (what `forward_choice` returned at the forward), in its own shape: a
    partial stays a partial of the same args and keywords, a bound method stays bound to the same object (so
    `func.func.__self__` is still the layer), a function stays a function of the same name (`functools.wraps`)."""
    if captured is _NO_FORWARD:
        return function
    if isinstance(function, functools.partial):
        return functools.partial(_carrying(captured, function.func), *function.args, **function.keywords)
    owner = getattr(function, "__self__", None)
    if isinstance(function, types.MethodType) and owner is not None:
        return types.MethodType(_run_under(captured, function, bound=True), owner)
    return _run_under(captured, function)


def _run_under(captured, function, bound: bool = False):
    """`function` called under the captured choice (`replayed_choice`); as a bound method's function (`bound`) the
    object it is bound to is dropped, `function` being bound to it already."""

    @functools.wraps(function)
    def run_under_the_choice(*args, **kwargs):
        with replayed_choice(captured):
            return function(*args[bound:], **kwargs)

    return run_under_the_choice


CHOOSER: list = []  # by_need.choose_switches, registered when the package loads


def choose_switches(model, call: dict, ctx, device):
    """The switches of this CP forward, chosen by the registered chooser (`by_need.choose_switches`: its contract);
    None where none is registered (the explicit settings alone act)."""
    return CHOOSER[0](model, call, ctx, device) if CHOOSER else None


def features_on_host() -> bool:
    """Whether a CP forward parks its vision features on the host (`offload.park_features`): as set
    (`VLMCP_OFFLOAD_FEATURES`), else by need — with the checkpoint offload on, where the choice in effect (the
    forward's, `choice_in_effect`) needed it."""
    setting = SETTINGS.offload_features
    if setting != AUTO:
        return bool(setting)
    choice = choice_in_effect()
    return SETTINGS.offload_checkpoints and cp_size() > 1 and choice is not None and choice.switches.features
