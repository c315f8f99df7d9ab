"""The releases of the training stacks this vlmcp-patch release was checked on (docs/versions.md), and the refusal,
under CP and before any step, of those it cannot train with.

`pyproject.toml`'s extras declare the same ranges, so that `pip install vlmcp-patch[examples]` never brings a
release outside them; these checks cover a release installed anyway. Newer releases are not refused here: as for
transformers, what decides is whether the patch records still verify (their pinned sources, `patching.py`).

TRL changed how its trainers score tokens: from 1.15 they use TRL's fused LM head, which runs the backbone past
the model's forward (patched in integrations/trl.py, its source pinned for 1.16); before, SFT and DPO take logits
from the model's forward, which the package patches anyway. The RL trainers' batch building (integrations/trl_rl.py)
is pinned for 1.16. So which TRL trainers train exactly under CP depends on the release: `TRL_TRAINERS`.
"""

from __future__ import annotations

import importlib.metadata

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ..errors import UnsupportedSetupError

# The oldest release of each stack checked (the extras' lower bounds).
OLDEST = {"accelerate": "1.11.0", "deepspeed": "0.16.9", "peft": "0.18.0", "trl": "0.24.0"}

# The TRL trainers that train exactly under CP, per TRL release range (SFT of 1.4 to 1.14 with its loss_type "nll", not
# its chunked loss: below): the newest releases checked, and from the oldest checked on (DPO, GRPO and RLOO of TRL <
# 0.29 do not import on transformers 5: TRL reads transformers' `_is_package_available`, which returns a tuple there,
# as a bool). Any other trainer, or a release in none of the ranges (1.15: its fused head is not the pinned one), is
# refused under CP before the first step.
TRL_TRAINERS = {
    ">=1.16": ("SFTTrainer", "DPOTrainer", "KTOTrainer", "GRPOTrainer", "RLOOTrainer"),
    ">=0.29,<1.15": ("SFTTrainer", "DPOTrainer"),
    ">=0.24,<0.29": ("SFTTrainer",),
}


# TRL 1.4 to 1.14's SFT loss that projects the backbone's hidden states itself, in chunks (`_chunked_cross_entropy_loss`),
# past the model's forward; from 1.15 SFT scores with the fused head, which the package patches (`FUSED_HEAD`).
CHUNKED_LOSSES = ("chunked_nll",)
FUSED_HEAD = ">=1.15"


def installed(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_release(package: str, version: str | None = None) -> None:
    """Refuse a release of `package` older than the oldest checked (call it under CP only)."""
    version = version or installed(package)
    if package in OLDEST and version is not None and Version(version).release < Version(OLDEST[package]).release:
        raise UnsupportedSetupError(
            f"context parallelism under {package} {version} is not supported: vlmcp-patch was checked on {package} "
            f"{OLDEST[package]} and newer (docs/versions.md); upgrade it, e.g. pip install '{package}>={OLDEST[package]}', "
            "or set VLMCP_CP_SIZE=1."
        )


def trl_trainer_name(trainer) -> str | None:
    """The TRL trainer class `trainer` is (or derives from), e.g. "SFTTrainer"; None for a trainer that is not TRL's."""
    for cls in type(trainer).__mro__:
        if cls.__module__.startswith("trl.") and cls.__name__.endswith("Trainer"):
            return cls.__name__
    return None


def check_trl_trainer(trainer, version: str | None = None) -> None:
    """Refuse, under CP, a TRL trainer that this TRL release does not train exactly with the package (`TRL_TRAINERS`)."""
    name = trl_trainer_name(trainer) if not isinstance(trainer, str) else trainer
    if name is None:
        return
    version = version or installed("trl")
    check_release("trl", version)
    checked = next((names for spec, names in TRL_TRAINERS.items() if SpecifierSet(spec).contains(version,
                                                                                                  prereleases=True)), ())
    if name not in checked:
        ranges = "; ".join(f"trl{spec}: {', '.join(names)}" for spec, names in TRL_TRAINERS.items())
        raise UnsupportedSetupError(
            f"context parallelism with TRL's {name} is not supported on trl {version}: vlmcp-patch trains exactly with "
            f"{ranges}. Install a TRL release where {name} is listed (e.g. pip install 'trl>=1.16'), or set "
            "VLMCP_CP_SIZE=1."
        )
    loss_type = getattr(getattr(trainer, "args", None), "loss_type", None)
    if name == "SFTTrainer" and loss_type in CHUNKED_LOSSES and not SpecifierSet(FUSED_HEAD).contains(version):
        raise UnsupportedSetupError(
            f"context parallelism with TRL {version}'s SFTTrainer and loss_type={loss_type!r} (its default from 1.8 at "
            "the latest) is not supported: that loss runs the model's backbone past its forward, which CP does not "
            "run there. Set SFTConfig(loss_type='nll') (the same loss through the model's forward), install "
            "trl>=1.16, or set VLMCP_CP_SIZE=1."
        )
