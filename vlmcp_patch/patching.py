"""Declarative patch records, applied and reverted as one set.

Each record names its dotted target, what replaces it and why. Before anything is changed, every target is
resolved and checked against the installed packages: a missing attribute, a signature without the
parameters the replacement relies on, or (for code we mirror or rescale) an upstream source whose digest
is none of the pinned ones is a `PatchTargetError` naming the target and the version. A version
difference lives here, in the record: the spellings a parameter has had (`expects`), and one pinned digest
per upstream source with the versions it was checked on (`mirrors`). Applying twice is a no-op; `revert()`
puts the exact original objects back.

A core target that does not verify (a transformers release newer than the checked ones) never stops the
import: it is recorded in `PatchSet.unverified`, and the family it belongs to (`Patch.family`; None: every
family) is left stock — none of its patches is installed, only the `guard` its top-level forwards declare,
which calls stock with CP off and refuses under CP (`forward/unverified.py`). The other families are patched.

Patches of the optional stacks (TRL, DeepSpeed, Accelerate, the Trainer) are installed when the module that holds
their target has been imported (`target_module`), through wrapt's public post-import hooks: at once where it already
is, else when its import ends — never by importing it, and never into a module still running its own top-level code
(TRL's `sft_trainer` imports transformers first: the autowrapt hook imports the package there). One whose target no
longer verifies, or whose installation fails in any way, is refused alone with a warning naming it — the rest of the
package works, the import that triggered it succeeds — and the integration that needs it raises before the first
step under CP (`require_integration`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import sys
import threading
import types
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import wrapt

from .errors import PatchTargetError
from .settings import SETTINGS


def resolve(dotted: str):
    """(parent object, attribute name, current value) of a dotted path like `pkg.mod.Class.attr`."""
    parts = dotted.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        except Exception as exc:  # a module whose own import fails otherwise
            raise PatchTargetError(f"patch target {dotted} cannot be imported in {_version_of(dotted)}: "
                                   f"{type(exc).__name__}: {exc}") from exc
        try:
            for name in parts[split:-1]:
                obj = getattr(obj, name)
            return obj, parts[-1], getattr(obj, parts[-1])
        except AttributeError:
            break
        except Exception as exc:  # a lazy module that fails to import (TRL < 0.29 on transformers 5: RuntimeError)
            raise PatchTargetError(f"patch target {dotted} cannot be imported in {_version_of(dotted)}: "
                                   f"{type(exc).__name__}: {exc}") from exc
    raise PatchTargetError(f"patch target {dotted} does not exist in {_version_of(dotted)}")


def _innermost(obj, name: str):
    """The function a target really is: under a patch of ours, through functools.wraps, and through decorators that
    close over it without wraps (their inner function has the target's name)."""
    obj = inspect.unwrap(getattr(obj, "vlmcp_original", obj))
    for cell in getattr(obj, "__closure__", None) or ():
        inner = cell.cell_contents
        if inspect.isfunction(inner) and name.endswith(inner.__name__) and inner is not obj:
            return _innermost(inner, name)
    return obj


def source_digest(obj, name: str | None = None) -> str:
    """The first 16 hex digits of the sha256 of the target's source ("unreadable" without a source file). `name` is
    the attribute the target is found under (its own `__name__` by default): a decorator that wraps without
    functools.wraps (DeepSpeed's `instrument_w_nvtx`) returns a function of another name, and the source digested must
    be the target's, not that decorator's."""
    try:
        source = inspect.getsource(_innermost(obj, name or obj.__name__))
    except (OSError, TypeError):
        return "unreadable"
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def _version_of(dotted: str) -> str:
    package = dotted.split(".")[0]
    try:
        return f"{package} {importlib.metadata.version(package)}"
    except importlib.metadata.PackageNotFoundError:
        return package


Expected = str | tuple[str, ...]  # a parameter, or the spellings it has had across the supported versions


def _takes(params, expected: Expected) -> bool:
    return any(name in params for name in ((expected,) if isinstance(expected, str) else expected))


@dataclass(frozen=True)
class Patch:
    """Replace the function at `target` by one that calls `wrapper(wrapped, instance, args, kwargs)` (wrapt's
    convention; `patched_function`).

    `expects` lists parameters the target's signature must have (a tuple entry: any one of the spellings the
    parameter has had, e.g. `("past_key_values", "cache")`); `mirrors` maps each pinned digest of the
    upstream source (see `source_digest`) to the versions it was checked on, for a replacement that
    re-implements or rescales that source; `requires` names an optional package: when it is not installed
    the patch is skipped, not an error.
    """

    target: str
    wrapper: Callable
    reason: str
    expects: tuple[Expected, ...] = ()
    mirrors: Mapping[str, str] | None = None
    requires: str | None = None
    # the releases it applies to, e.g. "transformers>=5.20" (a target older releases lack), "transformers<5.9", "trl<1.15"
    since: str | None = None
    family: str | None = None  # the model family this patch serves (None: shared by every family)
    guard: Callable | None = None  # installed instead (unchecked) when this patch's family did not verify

    @property
    def checked_on(self) -> str | None:
        return None if not self.mirrors else "; ".join(self.mirrors.values())

    def check(self) -> None:
        _, name, current = resolve(self.target)
        original = getattr(current, "vlmcp_original", current)
        params = inspect.signature(_innermost(original, name)).parameters
        missing = [p for p in self.expects if not _takes(params, p)]
        if missing:
            raise PatchTargetError(
                f"patch target {self.target} in {_version_of(self.target)} has changed: "
                f"it no longer takes {missing}; this vlmcp-patch release does not support that version"
            )
        digest = None if self.mirrors is None else source_digest(original, name)
        if digest is not None and digest not in self.mirrors:
            raise PatchTargetError(
                f"patch target {self.target} in {_version_of(self.target)} has changed: its source (digest "
                f"{digest}) is none of those vlmcp-patch was checked on "
                f"({self.checked_on}); upgrade vlmcp-patch or install one of those versions"
            )

    def guarded(self) -> Patch | None:
        """The record that installs `guard` on this target (no parameters or digest relied on), or None when
        there is no guard or the target is gone."""
        if self.guard is None:
            return None
        try:
            resolve(self.target)
        except PatchTargetError:
            return None
        return Patch(target=self.target, wrapper=self.guard, reason="refuses CP: a target of this family did not "
                     "verify (with CP off it calls stock)", family=self.family)

    def apply(self) -> Callable[[], None]:
        parent, name, current = resolve(self.target)
        raw = inspect.getattr_static(parent, name)
        if _is_ours(current):
            return lambda: None
        is_method = inspect.isclass(parent) and inspect.isfunction(raw)
        if inspect.isclass(parent) and not is_method:
            raise PatchTargetError(f"patch target {self.target} is not a plain method ({type(raw).__name__})")
        inherited = inspect.isclass(parent) and name not in vars(parent)  # e.g. a layer's `__call__`, nn.Module's
        setattr(parent, name, patched_function(raw if is_method else current, self.wrapper, is_method))
        return (lambda: delattr(parent, name)) if inherited else (lambda: setattr(parent, name, raw))


def patched_function(original: Callable, wrapper: Callable, is_method: bool) -> Callable:
    """A plain function in place of `original` that calls `wrapper(wrapped, instance, args, kwargs)` (wrapt's
    convention). A plain function, not a proxy object: code that rebinds a method through its `__func__`
    (Accelerate's mixed precision) or unwraps it through `__wrapped__` (Accelerate's `unwrap_model`) keeps the
    patch, and torch.compile traces it like any function. With CP off, a traced call goes straight to the
    original, so a compiled model's graph is stock's."""
    if is_method:
        def replacement(self, *args, **kwargs):
            if torch.compiler.is_compiling() and cp_size() == 1:
                return original(self, *args, **kwargs)
            return wrapper(types.MethodType(original, self), self, args, kwargs)
    else:
        def replacement(*args, **kwargs):
            if torch.compiler.is_compiling() and cp_size() == 1:
                return original(*args, **kwargs)
            return wrapper(original, None, args, kwargs)

    for attribute in functools.WRAPPER_ASSIGNMENTS:  # what functools.wraps copies, without its `__wrapped__`
        if hasattr(original, attribute):  # the return annotation is read by transformers' output checks
            setattr(replacement, attribute, getattr(original, attribute))
    replacement.__signature__ = inspect.signature(original)
    replacement.vlmcp_original = original
    return replacement


class _OurProperty(property):
    """Marks properties installed by vlmcp-patch."""


def _is_ours(obj) -> bool:
    """Whether `obj` was installed by vlmcp-patch (so a second apply recognises it)."""
    return isinstance(obj, _OurProperty) or getattr(obj, "vlmcp_original", None) is not None


@dataclass(frozen=True)
class PropertyPatch:
    """Wrap the getter of the property at `target` (a class attribute) with `wrapper(getter, instance)`."""

    target: str
    wrapper: Callable
    reason: str
    requires: str | None = None

    def check(self) -> None:
        parent, name, _ = resolve(self.target)
        raw = inspect.getattr_static(parent, name)
        if not isinstance(raw, property):
            raise PatchTargetError(f"patch target {self.target} in {_version_of(self.target)} is no longer a property")

    def apply(self) -> Callable[[], None]:
        parent, name, _ = resolve(self.target)
        raw = inspect.getattr_static(parent, name)
        if _is_ours(raw):
            return lambda: None
        wrapper = self.wrapper
        getter = lambda instance: wrapper(raw.fget, instance)  # noqa: E731
        setattr(parent, name, _OurProperty(getter, raw.fset, raw.fdel, raw.__doc__))
        return lambda: setattr(parent, name, raw)


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
        _, _, interface = resolve(self.registry)
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


def _package(patch) -> str | None:
    return getattr(patch, "requires", None)


def target_module(target: str) -> str:
    """The module that holds a dotted target, named without importing anything: the parts before the first class
    (a capitalised part: `trl.trainer.sft_trainer` of `trl.trainer.sft_trainer.SFTTrainer.compute_loss`), else all
    but the last (`deepspeed` of `deepspeed.initialize`). Every optional target is a module's function or a
    module's class's attribute (tests/test_autowrapt.py checks each against the installed packages)."""
    parts = target.split(".")
    first_class = next((i for i, part in enumerate(parts) if part[:1].isupper()), len(parts) - 1)
    return ".".join(parts[:first_class])


def _importing_in_this_thread(module) -> bool:
    """Whether `module`'s top-level code is still running in this thread: a frame of this thread's stack runs the
    module's body (public frame attributes; the import system's own mark of a module in progress is private)."""
    frame, namespace = inspect.currentframe(), vars(module)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is namespace:
            return True
        frame = frame.f_back
    return False


def applies_here(patch, version: str | None = None) -> bool:
    """False for a patch declared (`since`) for releases other than the installed one, or than `version` of the
    package it names when given (`tools/check_release.py`): its target does not exist yet, or it is not needed."""
    since = getattr(patch, "since", None)
    if since is None:
        return True
    from packaging.requirements import Requirement

    requirement = Requirement(since)
    try:
        version = version or importlib.metadata.version(requirement.name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return requirement.specifier.contains(version, prereleases=True)


@dataclass
class PatchSet:
    """All of the package's patches, applied or reverted together; the one record of what is installed.

    Patches of optional packages (`requires`) are installed when the module holding their target has been
    imported (`on_module_imported`, the module docstring) — so importing vlmcp_patch never imports
    DeepSpeed, Accelerate or TRL itself. The core patches (transformers) are all-or-nothing per family: one
    target that does not verify leaves its family stock (`unverified`; its top-level forwards guarded) and
    never raises. An optional package's patches are checked one by one:
    one that does not verify is refused (`refused`) and the others install.
    """

    patches: list = field(default_factory=list)
    refused: dict = field(default_factory=dict)  # target -> (package, why) of optional patches that did not verify
    unverified: dict = field(default_factory=dict)  # target -> (family or None, why): core targets not verified
    _undo: dict = field(default_factory=dict)  # target -> undo function of the installed patches
    _active: bool = False
    _hooked: set = field(default_factory=set)  # modules whose wrapt post-import hook is registered
    _pending: set = field(default_factory=set)  # modules whose import had not ended when their hook ran
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)  # imports run in any thread

    @property
    def active(self) -> bool:
        """Whether the package is applied (CP helpers report P=1 when it is not)."""
        return self._active

    def add(self, *patches) -> None:
        """Declare patches; declaring a target again (e.g. after `importlib.reload(vlmcp_patch)`) keeps one record."""
        known = {p.target: i for i, p in enumerate(self.patches)}
        for patch in patches:
            if patch.target in known:
                self.patches[known[patch.target]] = patch
            else:
                known[patch.target] = len(self.patches)
                self.patches.append(patch)

    def _install(self, patches: list) -> None:
        """Check every core patch before changing anything; install those of the families whose targets all
        verified, and the guards of the others (see the module docstring)."""
        patches = [p for p in patches if applies_here(p)]
        for patch in patches:
            try:
                patch.check()
            except PatchTargetError as exc:
                self.unverified[patch.target] = (getattr(patch, "family", None), str(exc))
        blocked = {family for family, _ in self.unverified.values()}
        for patch in patches:
            family = getattr(patch, "family", None)
            if patch.target in self.unverified or (family is not None and blocked & {None, family}):
                patch = patch.guarded() if isinstance(patch, Patch) else None
                if patch is None:
                    continue
                try:
                    self._undo[patch.target] = patch.apply()
                except PatchTargetError:  # not even a plain method any more: nothing to guard, stock stays
                    pass
                continue
            self._undo[patch.target] = patch.apply()

    def unverified_for(self, family: str) -> list[tuple[str, str]]:
        """(target, why) of each core target that did not verify and that `family` needs (its own, and shared)."""
        return [(t, why) for t, (fam, why) in self.unverified.items() if fam in (None, family)]

    def on_module_imported(self, module) -> None:
        """wrapt's post-import hook of a module holding optional targets (`target_module`), also called by the
        autowrapt hook for modules whose import had begun before the package arrived: install that module's
        patches, unless its top-level code is still running in this thread (then when it has finished)."""
        if not self._active:
            return
        if _importing_in_this_thread(module):
            self._pending.add(module.__name__)
            return
        self._settle()
        self._install_module(module.__name__)

    def _settle(self) -> None:
        """Install the patches of the modules left pending whose import has ended since."""
        for name in sorted(self._pending):
            module = sys.modules.get(name)
            if module is not None and not _importing_in_this_thread(module):
                self._pending.discard(name)
                self._install_module(name)

    def _install_module(self, name: str) -> None:
        """Check and install the optional patches whose target lives in module `name`, each on its own: one that
        fails is refused with a warning naming it (`refused`), never raised into the import that triggered this."""
        importlib.import_module(name)  # waits while another thread still runs its import; this thread's: returns
        with self._lock:
            for patch in self.patches:
                package = _package(patch)
                if (package is None or target_module(patch.target) != name or patch.target in self._undo
                        or patch.target in self.refused or not applies_here(patch)):
                    continue
                try:
                    patch.check()
                    self._undo[patch.target] = patch.apply()
                except Exception as exc:  # noqa: BLE001 - reported and refused, never raised into an import
                    why = str(exc) if isinstance(exc, PatchTargetError) else (
                        f"patch {patch.target} failed to install: {type(exc).__name__}: {exc}")
                    self.refused[patch.target] = (package, why)
                    warnings.warn(f"vlmcp-patch: {why}. Context parallelism under {package} is refused.",
                                  stacklevel=2)

    def _watch(self, name: str) -> None:
        """Register `on_module_imported` as wrapt's post-import hook of module `name` once (wrapt calls it at once
        where the module is already in `sys.modules`)."""
        with self._lock:
            if name in self._hooked:
                return
            self._hooked.add(name)
        wrapt.register_post_import_hook(self.on_module_imported, name)

    def apply(self) -> None:
        with self._lock:
            if self._active:
                return
            core, modules = [], set()
            for patch in self.patches:
                package = _package(patch)
                if package is None:
                    core.append(patch)
                elif package in sys.modules or importlib.util.find_spec(package) is not None:
                    modules.add(target_module(patch.target))
            self._install(core)
            self._active = True
        # outside the lock: a hook may wait for another thread's import, whose own hook needs the lock
        for name in sorted(modules):
            if name in self._hooked and name in sys.modules:
                self.on_module_imported(sys.modules[name])  # hooked before (a revert, then apply again)
            else:
                self._watch(name)

    def revert(self) -> None:
        for target in reversed(list(self._undo)):
            self._undo.pop(target)()
        self._pending.clear()
        self.refused.clear()
        self.unverified.clear()
        self._active = False

    def refusals(self, package: str) -> list[str]:
        """Why the patches of `package` that did not verify were refused (empty when all installed). Read before
        the first step under CP (`require_integration`): the patches of a module whose import had not ended when
        its hook ran are installed first."""
        self._settle()
        return [why for pkg, why in self.refused.values() if pkg == package or pkg.startswith(f"{package}.")]

    def _why_not_installed(self, patch) -> str | None:
        """The refusal of an optional patch, the check failure of a core one, or why its family was left stock."""
        if patch.target in self.refused:
            return self.refused[patch.target][1]
        if patch.target in self.unverified:
            return self.unverified[patch.target][1]
        family = getattr(patch, "family", None)
        blocked = [target for target, _ in self.unverified_for(family)] if family is not None else []
        return f"left stock with its family: {', '.join(blocked)} did not verify" if blocked else None

    def status(self) -> list[dict]:
        return [
            {
                "target": p.target,
                "reason": p.reason,
                "applied": p.target in self._undo,
                "refused": self._why_not_installed(p),
                "requires": _package(p),
                "mirrors": dict(getattr(p, "mirrors", None) or {}) or None,
                "checked_on": getattr(p, "checked_on", None),
                "since": getattr(p, "since", None),
                "applies_here": applies_here(p),  # False: declared for newer releases than the installed one
            }
            for p in self.patches
        ]


# The package's patches: filled by the modules that declare them, applied by `vlmcp_patch.apply()`.
PATCHES = PatchSet()


def cp_size() -> int:
    """The CP size in effect: the configured one (`settings.SETTINGS`) while the package is applied, 1 when it is off
    (`VLMCP_DISABLE=1`, `revert()`). It lives here, beside the record of what is applied, so that settings.py needs
    nothing of the package and no import runs in a circle."""
    return SETTINGS.cp_size if PATCHES.active else 1
