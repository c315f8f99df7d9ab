"""Declarative patch records, applied and reverted as one set.

Each record names its dotted target in transformers, what replaces it and why. Before anything is
changed, every target is resolved and checked against the installed transformers: a missing
attribute, a signature without the parameters the replacement relies on, or (for code we mirror) a
changed upstream source raises `PatchTargetError` naming the target and the version. Applying twice
is a no-op; `revert()` puts the exact original objects back.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import transformers
import wrapt

from .errors import PatchTargetError


def _resolve(dotted: str):
    """(parent object, attribute name, current value) of a dotted path like `pkg.mod.Class.attr`."""
    parts = dotted.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for name in parts[split:-1]:
                obj = getattr(obj, name)
            return obj, parts[-1], getattr(obj, parts[-1])
        except AttributeError:
            break
    raise PatchTargetError(f"patch target {dotted} does not exist in transformers {transformers.__version__}")


def source_digest(obj) -> str:
    return hashlib.sha256(inspect.getsource(inspect.unwrap(obj)).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Patch:
    """Wrap the function at `target` with a wrapt wrapper `wrapper(wrapped, instance, args, kwargs)`.

    `expects` lists parameters the target's signature must have; `mirrors` pins the digest of the
    upstream source when the replacement re-implements it (see `source_digest`); `requires` names an
    optional package: when it is not installed the patch is skipped, not an error.
    """

    target: str
    wrapper: Callable
    reason: str
    expects: tuple[str, ...] = ()
    mirrors: str | None = None
    requires: str | None = None

    def check(self) -> None:
        _, _, current = _resolve(self.target)
        original = getattr(current, "__wrapped__", current) if _is_ours(current) else current
        params = inspect.signature(original).parameters
        missing = [p for p in self.expects if p not in params]
        if missing:
            raise PatchTargetError(
                f"patch target {self.target} in transformers {transformers.__version__} has changed: "
                f"it no longer takes {missing}; this vlmcp-patch release does not support that version"
            )
        if self.mirrors is not None and source_digest(original) != self.mirrors:
            raise PatchTargetError(
                f"patch target {self.target} in transformers {transformers.__version__} has changed: its source "
                f"differs from the version vlmcp-patch mirrors ({self.mirrors}); upgrade vlmcp-patch or pin transformers"
            )

    def apply(self) -> Callable[[], None]:
        parent, name, _ = _resolve(self.target)
        raw = inspect.getattr_static(parent, name)
        if _is_ours(getattr(parent, name)):
            return lambda: None
        setattr(parent, name, _OurWrapper(getattr(parent, name), self.wrapper))
        return lambda: setattr(parent, name, raw)


class _OurWrapper(wrapt.FunctionWrapper):
    """Marks wrappers installed by vlmcp-patch, so a second apply recognises them."""


def _is_ours(obj) -> bool:
    return isinstance(obj, _OurWrapper) or getattr(obj, "vlmcp_original", None) is not None


@dataclass(frozen=True)
class RegistryPatch:
    """Replace entry `key` of a transformers registry (e.g. `AttentionInterface`) by `factory(original)`."""

    registry: str
    key: str
    factory: Callable[[Callable], Callable]
    reason: str

    @property
    def target(self) -> str:
        return f"{self.registry}[{self.key!r}]"

    def _mapping(self) -> dict:
        _, _, interface = _resolve(self.registry)
        mapping = getattr(interface, "_global_mapping", None)
        if not isinstance(mapping, dict) or not hasattr(interface, "register"):
            raise PatchTargetError(
                f"patch target {self.registry} in transformers {transformers.__version__} is no longer a registry "
                "with `register` and a global mapping"
            )
        return mapping

    def check(self) -> None:
        if self.key not in self._mapping():
            raise PatchTargetError(
                f"patch target {self.target} does not exist in transformers {transformers.__version__}"
            )

    def apply(self) -> Callable[[], None]:
        mapping = self._mapping()
        original = mapping[self.key]
        if _is_ours(original):
            return lambda: None
        mapping[self.key] = self.factory(original)
        return lambda: mapping.__setitem__(self.key, original)


@dataclass
class PatchSet:
    """All of the package's patches, applied or reverted together."""

    patches: list = field(default_factory=list)
    _undo: list = field(default_factory=list)

    def add(self, *patches) -> None:
        self.patches.extend(patches)

    @property
    def applied(self) -> bool:
        return bool(self._undo)

    def _installable(self) -> list:
        return [p for p in self.patches if getattr(p, "requires", None) is None or importlib.util.find_spec(p.requires)]

    def apply(self) -> None:
        if self.applied:
            return
        patches = self._installable()
        for patch in patches:  # check everything before changing anything
            patch.check()
        for patch in patches:
            self._undo.append(patch.apply())

    def revert(self) -> None:
        while self._undo:
            self._undo.pop()()

    def status(self) -> list[dict]:
        installable = self._installable()
        return [{"target": p.target, "reason": p.reason, "applied": self.applied and p in installable} for p in self.patches]
