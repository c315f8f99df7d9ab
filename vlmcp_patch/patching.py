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
import importlib.metadata
import importlib.util
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

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
    raise PatchTargetError(f"patch target {dotted} does not exist in {_version_of(dotted)}")


def _innermost(obj, name: str):
    """The function a target really is: through functools.wraps, and through decorators that close over
    it without wraps (their inner function has the target's name)."""
    obj = inspect.unwrap(obj)
    for cell in getattr(obj, "__closure__", None) or ():
        inner = cell.cell_contents
        if inspect.isfunction(inner) and name.endswith(inner.__name__) and inner is not obj:
            return _innermost(inner, name)
    return obj


def source_digest(obj) -> str:
    return hashlib.sha256(inspect.getsource(_innermost(obj, obj.__name__)).encode()).hexdigest()[:16]


def _version_of(dotted: str) -> str:
    package = dotted.split(".")[0]
    try:
        return f"{package} {importlib.metadata.version(package)}"
    except importlib.metadata.PackageNotFoundError:
        return package


@dataclass(frozen=True)
class Patch:
    """Wrap the function at `target` with a wrapt wrapper `wrapper(wrapped, instance, args, kwargs)`.

    `expects` lists parameters the target's signature must have; `mirrors` pins the digest of the
    upstream source when the replacement re-implements or rescales it (see `source_digest`), and
    `checked_on` declares the version range that source was checked on; `requires` names an optional
    package: when it is not installed the patch is skipped, not an error.
    """

    target: str
    wrapper: Callable
    reason: str
    expects: tuple[str, ...] = ()
    mirrors: str | None = None
    checked_on: str | None = None
    requires: str | None = None

    def check(self) -> None:
        _, name, current = _resolve(self.target)
        original = getattr(current, "__wrapped__", current) if _is_ours(current) else current
        params = inspect.signature(_innermost(original, name)).parameters
        missing = [p for p in self.expects if p not in params]
        if missing:
            raise PatchTargetError(
                f"patch target {self.target} in {_version_of(self.target)} has changed: "
                f"it no longer takes {missing}; this vlmcp-patch release does not support that version"
            )
        if self.mirrors is not None and source_digest(original) != self.mirrors:
            raise PatchTargetError(
                f"patch target {self.target} in {_version_of(self.target)} has changed: its source differs "
                f"from the version vlmcp-patch mirrors ({self.mirrors}); upgrade vlmcp-patch or pin that version"
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
                f"patch target {self.registry} in {_version_of(self.registry)} is no longer a registry "
                "with `register` and a global mapping"
            )
        return mapping

    def check(self) -> None:
        if self.key not in self._mapping():
            raise PatchTargetError(f"patch target {self.target} does not exist in {_version_of(self.registry)}")

    def apply(self) -> Callable[[], None]:
        mapping = self._mapping()
        original = mapping[self.key]
        if _is_ours(original):
            return lambda: None
        mapping[self.key] = self.factory(original)
        return lambda: mapping.__setitem__(self.key, original)


@dataclass
class PatchSet:
    """All of the package's patches, applied or reverted together.

    Patches of optional packages (`requires`) are installed when that package is imported — at once
    if it already is, otherwise by a wrapt post-import hook — so importing vlmcp_patch never imports
    DeepSpeed or Accelerate itself.
    """

    patches: list = field(default_factory=list)
    _undo: dict = field(default_factory=dict)  # target -> undo function of the installed patches
    _active: bool = False
    _hooked: set = field(default_factory=set)

    def add(self, *patches) -> None:
        self.patches.extend(patches)

    def _install(self, patches: list) -> None:
        for patch in patches:  # check everything before changing anything
            patch.check()
        for patch in patches:
            self._undo[patch.target] = patch.apply()

    def _when_imported(self, package: str) -> None:
        if package in self._hooked:
            return
        self._hooked.add(package)

        @wrapt.when_imported(package)
        def install(_module):
            if self._active:
                self._install([p for p in self.patches if getattr(p, "requires", None) == package])

    def apply(self) -> None:
        if self._active:
            return
        now, later = [], set()
        for patch in self.patches:
            package = getattr(patch, "requires", None)
            if package is None or package in sys.modules:
                now.append(patch)
            elif importlib.util.find_spec(package) is not None:
                later.add(package)
        self._install(now)
        self._active = True
        for package in sorted(later):
            self._when_imported(package)

    def revert(self) -> None:
        for target in reversed(list(self._undo)):
            self._undo.pop(target)()
        self._active = False

    def status(self) -> list[dict]:
        return [
            {
                "target": p.target,
                "reason": p.reason,
                "applied": p.target in self._undo,
                "requires": getattr(p, "requires", None),
                "mirrors": getattr(p, "mirrors", None),
                "checked_on": getattr(p, "checked_on", None),
            }
            for p in self.patches
        ]
