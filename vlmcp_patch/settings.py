"""User-facing configuration: the CP size and output options.

`VLMCP_CP_SIZE` (default 1) is read when the package is imported; `enable()` overrides it at run time.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from dataclasses import dataclass

from .errors import UnsupportedSetupError


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise UnsupportedSetupError(f"{name}={raw!r} is not an integer; set it to the CP size, e.g. {name}=2") from None


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


@dataclass
class Settings:
    cp_size: int = 1
    # With labels, logits stay sharded (each rank holds its slice) unless this is set.
    gather_logits_with_labels: bool = False

    def validate(self) -> None:
        if not isinstance(self.cp_size, int) or self.cp_size < 1:
            raise UnsupportedSetupError(f"cp_size must be a positive integer, got {self.cp_size!r}")


SETTINGS = Settings(
    cp_size=_env_int("VLMCP_CP_SIZE", 1),
    gather_logits_with_labels=env_flag("VLMCP_GATHER_LOGITS"),
)
SETTINGS.validate()


def enable(cp_size: int | None = None, *, gather_logits_with_labels: bool | None = None) -> Settings:
    """Set the CP size (and output options) for every following forward.

    `cp_size=1` turns CP off: the patched models then behave exactly like stock transformers.
    """
    new = Settings(
        cp_size=SETTINGS.cp_size if cp_size is None else cp_size,
        gather_logits_with_labels=(
            SETTINGS.gather_logits_with_labels if gather_logits_with_labels is None else gather_logits_with_labels
        ),
    )
    new.validate()
    SETTINGS.cp_size = new.cp_size
    SETTINGS.gather_logits_with_labels = new.gather_logits_with_labels
    return SETTINGS


def cp_size() -> int:
    return SETTINGS.cp_size


# Set inside callers that need the full logits with labels for one call (the Trainer's prediction step).
_FULL_LOGITS = contextvars.ContextVar("vlmcp_full_logits", default=False)


@contextlib.contextmanager
def full_logits():
    """Forwards in this block return gathered (full-sequence) logits even when labels are given."""
    token = _FULL_LOGITS.set(True)
    try:
        yield
    finally:
        _FULL_LOGITS.reset(token)


def gather_logits_with_labels() -> bool:
    return SETTINGS.gather_logits_with_labels or _FULL_LOGITS.get()
