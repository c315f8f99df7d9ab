"""Exceptions raised by vlmcp-patch. Each message says what to change."""

from __future__ import annotations

from dataclasses import dataclass


class VLMCPError(RuntimeError):
    """Base class of every error raised by vlmcp-patch."""


class PatchTargetError(VLMCPError):
    """A patch target is missing from, or has changed in, the installed transformers."""


class UnsupportedSetupError(VLMCPError, ValueError):
    """The model, its configuration or the distributed setup cannot run exactly under CP."""


class CPInputError(VLMCPError, ValueError):
    """A batch that context parallelism cannot split exactly (or that is malformed)."""


@dataclass(frozen=True)
class Problem:
    """A reason this rank cannot run a forward, found before compute and raised later on every rank of its group
    together (`forward/agreement.py`): the error's type and message."""

    error: type
    message: str

    def raise_it(self):
        raise self.error(self.message)


class UnsummedGradientsError(VLMCPError):
    """An optimizer step on gradients that are still each rank's share under CP (`grad_shares.py`)."""


class CollectiveError(VLMCPError):
    """A collective of the CP group failed or did not complete within the groups' timeout, or the ranks of a group
    issued different collectives (`VLMCP_DEBUG_COLLECTIVES=1`)."""
