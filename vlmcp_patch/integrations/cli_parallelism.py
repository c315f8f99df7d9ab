"""A CLI's own sequence parallelism beside the package's CP: refused at setup, naming both (issue 64).

Both would split each sequence over ranks, each with its own exchange, data split and loss: together they cannot run
(ms-swift's Ulysses beside the package's fails on its packed-row inputs; axolotl's ring attention patches the
attention the package runs). Each is refused where the CLI sets its own up, before the model is loaded or wrapped,
when `VLMCP_CP_SIZE` (or `vlmcp_patch.enable(cp_size=...)`) is above 1:

* ms-swift (`--sequence_parallel_size N`): `swift.sequence_parallel.SequenceParallel.prepare(sp_size, model, ...)`,
  which `swift sft` / `swift rlhf` call right after loading the model (ms-swift 4; checked on 4.6.0);
* axolotl (`context_parallel_size: N`, or the older spelling `sequence_parallel_degree: N`): its `ModelLoader`, built
  from the validated config before the model loads (checked on 0.19.0);
* Accelerate's / the HF Trainer's `ParallelismConfig(sp_size=N)` / `(cp_size=N)` are taken over, not refused: the
  package runs that CP, and a `VLMCP_CP_SIZE` that differs is refused (integrations/parallelism_config.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

from ..distributed import cp_requested
from ..errors import UnsupportedSetupError
from ..patching import Patch, cp_size


def _argument(wrapped, args, kwargs, name: str):
    try:
        return inspect.signature(wrapped).bind(*args, **kwargs).arguments.get(name)
    except TypeError:
        return None  # stock raises its own error


def _both(theirs: str, fix_theirs: str) -> UnsupportedSetupError:
    return UnsupportedSetupError(
        f"{theirs} and vlmcp_patch's context parallelism (VLMCP_CP_SIZE={cp_size()}) both split each sequence over "
        f"ranks; they cannot run together. Use one of them: {fix_theirs} to run vlmcp_patch's CP, or unset "
        "VLMCP_CP_SIZE (or set it to 1) to run the CLI's own."
    )


def cp_swift_sequence_parallel(wrapped, instance, args, kwargs):
    size = _argument(wrapped, args, kwargs, "sp_size")
    if cp_requested() and isinstance(size, int) and size > 1:
        raise _both(f"ms-swift's sequence parallelism (--sequence_parallel_size {size})",
                    "drop --sequence_parallel_size (or pass 1)")
    return wrapped(*args, **kwargs)


def _config_value(cfg, name: str):
    value = getattr(cfg, name, None)
    if value is None and isinstance(cfg, Mapping):
        value = cfg.get(name)
    return value


def cp_axolotl_model_loader(wrapped, instance, args, kwargs):
    cfg = _argument(wrapped, args, kwargs, "cfg")
    if cp_requested() and cfg is not None:
        for name in ("context_parallel_size", "sequence_parallel_degree"):
            size = _config_value(cfg, name)
            if isinstance(size, int) and size > 1:
                raise _both(f"axolotl's context parallelism ({name}: {size})",
                            "remove context_parallel_size / sequence_parallel_degree from the axolotl config (or set "
                            "it to 1)")
    return wrapped(*args, **kwargs)


def patches() -> list[Patch]:
    return [
        Patch(
            target="swift.sequence_parallel.sequence_parallel.SequenceParallel.prepare",
            wrapper=cp_swift_sequence_parallel,
            reason="under CP: ms-swift's own sequence parallelism splits the same sequences; refused at setup, "
            "naming both",
            expects=("sp_size",),
            requires="swift",
            since="ms-swift>=4",  # ms-swift 3 kept it in swift.trainers.sequence_parallel (and pins transformers 4)
        ),
        Patch(
            target="axolotl.loaders.model.ModelLoader.__init__",
            wrapper=cp_axolotl_model_loader,
            reason="under CP: axolotl's own context parallelism (context_parallel_size / sequence_parallel_degree) "
            "splits the same sequences; refused at setup, naming both",
            expects=("cfg",),
            requires="axolotl",
        ),
    ]
