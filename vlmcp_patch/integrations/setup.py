"""The setup check the training integrations run before the first step under CP."""

from __future__ import annotations

from ..distributed import cp_requested, get_cp_group
from ..errors import UnsupportedSetupError
from ..forward.refusals import check_model_config
from ..patching import PATCHES, cp_size
from ..supported import find_supported_model, unsupported_model_message
from .releases import check_release


def require_integration(package: str) -> None:
    """Under CP, refuse an integration whose patches did not verify on the installed `package` (a newer release
    whose pinned source changed), or a release older than the oldest checked (`releases.OLDEST`): CP would otherwise
    train wrongly there. No-op at P=1 or when all verified."""
    if cp_requested():
        check_release(package)  # older than the oldest checked
    refusals = PATCHES.refusals(package)
    if refusals and cp_requested():
        raise UnsupportedSetupError(
            f"context parallelism under {package} needs patches that did not verify on the installed {package}: "
            + "; ".join(refusals)
            + f". Install a {package} release this vlmcp-patch was checked on (python -m vlmcp_patch lists them), "
            "or set VLMCP_CP_SIZE=1."
        )


def check_cp_setup(model) -> None:
    """Raise a clear `UnsupportedSetupError` if `model` cannot train under the CP size in effect: a model the
    package does not run under CP (the integrations would otherwise shard its data and scale its gradients
    for nothing), a configuration that cannot split (attention, heads), or a launch whose world size P does
    not divide. No-op at P=1."""
    if cp_size() == 1:
        return
    found = find_supported_model(model)
    if found is None:
        raise UnsupportedSetupError(unsupported_model_message(type(model).__name__, cp_size()))
    if type(model).__module__.startswith("peft.") or hasattr(model, "peft_config"):
        check_release("peft")
    check_model_config(found.config.get_text_config(), cp_size())
    get_cp_group()  # torch.distributed is up and P divides the world size
