"""The entry without a line of code: `AUTOWRAPT_BOOTSTRAP=vlmcp_patch` (with autowrapt installed, the
`vlmcp-patch[autowrapt]` extra) makes any Python program of the environment import vlmcp_patch right after its
first `import transformers`, as if the line after that import were `import vlmcp_patch`.

autowrapt's startup file reads the variable in every interpreter; wrapt then loads this module (the
`[project.entry-points.vlmcp_patch]` entry `transformers`) at startup and registers `on_transformers_import` as a
post-import hook of `transformers`. That is why it lives outside the package and imports nothing: a process that never
imports transformers loads this file and nothing of vlmcp_patch, torch or transformers. Without the variable,
autowrapt loads nothing beyond its own one file and this module is never read.
"""

import sys


def on_transformers_import(module) -> None:
    """wrapt's post-import hook of `transformers` (the module, just imported): install vlmcp_patch's patches, exactly
    what `import vlmcp_patch` does (VLMCP_CP_SIZE, VLMCP_DISABLE and the other settings read as there).

    When transformers is first imported by another module's import (TRL's `trl.SFTConfig` imports it from
    `trl.trainer.sft_config`), that import is not finished: the package's TRL patches, which resolve `trl.SFTTrainer`,
    would import TRL's half-initialized modules again (a circular import). The package is then imported as soon as
    the outermost import in progress ends — where a script's `import vlmcp_patch` on the next line would run."""
    outermost = _outermost_import_in_progress()
    if outermost is None or not _when_finished(outermost, _import_the_package):
        _import_the_package()


def _import_the_package() -> None:
    import vlmcp_patch  # noqa: F401 - the import applies the patches


def _outermost_import_in_progress():
    """The spec of the first-started module import that has not finished (`ModuleSpec._initializing`, which the
    import system sets while it runs a module's code), or None."""
    for name, loaded in list(sys.modules.items()):
        spec = getattr(loaded, "__spec__", None)
        if name != "transformers" and getattr(spec, "_initializing", False):
            return spec
    return None


def _when_finished(spec, callback) -> bool:
    """Call `callback` once the import of `spec` ends: the import system clears `spec._initializing` last, after the
    module is in `sys.modules` (importlib's `_load_unlocked`). The spec's class is swapped for a subclass whose
    `_initializing` setter notices that. False where the spec's class cannot be swapped (the caller acts now)."""
    base = type(spec)

    class _NotifyingSpec(base):
        @property
        def _initializing(self):
            return self.__dict__.get("_initializing", False)

        @_initializing.setter
        def _initializing(self, value):
            self.__dict__["_initializing"] = value
            if not value:
                self.__class__ = base  # once
                callback()

    try:
        spec.__class__ = _NotifyingSpec
    except TypeError:  # a spec class with a layout of its own
        return False
    return True
