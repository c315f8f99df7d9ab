"""The HF Trainer's own bookkeeping under CP: counts that assume every rank is a data-parallel replica,
and the predictions of its evaluation loop.

The P ranks of a CP group train on the same micro-batches, so there are W/P replicas, not W. Two of
the Trainer's figures count per rank: the total train batch size (behind `train_samples_per_second`
and the samples count in the run summary) and `num_input_tokens_seen` (a sum over all W ranks). Both
are put back to the P=1 values; the loss and gradients never depend on them.

With labels, the CP forward computes the loss without materializing logits; the evaluation loop's
predictions (`compute_metrics`, `Trainer.predict`) need whole rows, so its prediction step asks for full
logits whenever it keeps them (`accelerate.gather_for_metrics` then keeps one copy per CP group).
"""

from __future__ import annotations

import inspect

from ..distributed import cp_requested, cp_running
from ..flags import FULL_LOGITS, scoped
from ..patching import Patch, cp_size
from .accelerate import one_copy_per_cp_group_gathers
from .parallelism_config import take_over_trainer_config
from .releases import check_trl_trainer, trl_trainer_name
from .setup import check_cp_setup, require_integration


def _required_integrations(trainer) -> list[str]:
    """The optional stacks whose patches this Trainer's CP run relies on."""
    needed = ["accelerate"]
    if trl_trainer_name(trainer) is not None:  # a TRL trainer, or a script's subclass of one
        needed.append("trl")
    if getattr(trainer.args, "deepspeed", None):
        needed.append("deepspeed")
    return needed


def cp_create_accelerator(wrapped, instance, args, kwargs):
    for package in _required_integrations(instance):
        require_integration(package)
    take_over_trainer_config(instance)
    if cp_requested():
        check_trl_trainer(instance)  # a TRL trainer this TRL release does not train exactly under CP
    result = wrapped(*args, **kwargs)
    check_cp_setup(instance.model)
    return result


def cp_total_train_batch_size(wrapped, instance, args, kwargs):
    total = wrapped(*args, **kwargs)
    return total // cp_size() if cp_running() else total


def cp_track_num_input_tokens(wrapped, instance, args, kwargs):
    # Its count is an `accelerator.gather` over all W ranks: gather one copy per CP group instead.
    with one_copy_per_cp_group_gathers():
        return wrapped(*args, **kwargs)


def cp_prediction_step(wrapped, instance, args, kwargs):
    call = inspect.signature(wrapped).bind(*args, **kwargs).arguments
    if not cp_running() or call.get("prediction_loss_only"):
        return wrapped(*args, **kwargs)
    with scoped(FULL_LOGITS, True):
        return wrapped(*args, **kwargs)


def patches() -> list[Patch]:
    return [
        Patch(
            target="transformers.trainer.Trainer.create_accelerator_and_postprocess",
            wrapper=cp_create_accelerator,
            reason="as soon as the Trainer's accelerator exists (before its data loaders are prepared): route "
            "Accelerate's ParallelismConfig to CP for supported models, and under CP refuse a model that does not "
            "run CP before the first step",
            expects=(),
            requires="transformers.trainer",  # installed when the Trainer is imported, not by vlmcp_patch
        ),
        Patch(
            target="transformers.trainer.Trainer.get_total_train_batch_size",
            wrapper=cp_total_train_batch_size,
            reason="under CP: the Trainer counts all W ranks as replicas; there are W/P (samples per second, "
            "samples in the run summary)",
            expects=("args",),
            requires="transformers.trainer",
        ),
        Patch(
            target="transformers.trainer.Trainer._track_num_input_tokens",
            wrapper=cp_track_num_input_tokens,
            reason="under CP: num_input_tokens_seen sums the batches of all W ranks, and the P ranks of a CP "
            "group hold the same batch; count it once per group",
            expects=("inputs",),
            requires="transformers.trainer",
            # 5.2 counts the tokens inside its training loop, with no method to patch (docs/versions.md)
            since="transformers>=5.3",
        ),
        Patch(
            target="transformers.trainer.Trainer.prediction_step",
            wrapper=cp_prediction_step,
            reason="under CP: the evaluation loop keeps whole-row logits for compute_metrics / predict, while "
            "the CP forward builds no logits when it has labels; ask for full logits when they are kept",
            expects=("model", "inputs", "prediction_loss_only"),
            requires="transformers.trainer",
        ),
    ]
