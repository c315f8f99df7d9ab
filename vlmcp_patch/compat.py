"""The transformers releases this release is tested on, checked at import.

There is no blanket version refusal: what decides whether the package can run is whether every patch
target still verifies (`patching.py`: the parameters each patch relies on, and the pinned source digests
of the code it re-implements, declared with the versions they were checked on). Below the oldest tested
release, 5.2, it refuses at import: transformers 5.0 and 5.1 ship another Qwen3.5 (26 of the 57 patch targets
verify there, `tools/check_release.py`). From 5.2 on, what differs between releases is declared where it
applies (docs/versions.md): 5.2's models take no `mm_token_type_ids` (stock finds the images from the
placeholder tokens; the package passes the token types only where a function takes them), the vision towers
take no per-patch tables before 5.15 (their images are shared by items, never cut into patch slices), and the
gated DeltaNet layer keeps its kernels on itself before 5.15 and its decoder layer does not hand it the CP
context before 5.9 (`models/qwen3_5.py`). A newer, untested release never raises at import: it imports with
one warning — naming each target that did not verify and the newest release checked, when some did not (their
families stay stock and refuse CP, `forward/unverified.py`), or saying that every target still verifies.
"""

from __future__ import annotations

import warnings

import transformers
from packaging.version import Version

from .errors import UnsupportedSetupError

OLDEST = Version("5.2.0")  # the oldest release CI runs on
NEWEST = Version("5.25.0")  # the newest release CI runs on
TESTED = f">={OLDEST.major}.{OLDEST.minor},<{NEWEST.major}.{NEWEST.minor + 1}"


class UntestedVersionWarning(UserWarning):
    """transformers is newer than the releases this vlmcp-patch release was tested on."""


def check_transformers_version(version: str = transformers.__version__) -> None:
    """Refuse a transformers older than the oldest tested release."""
    if Version(version).release < OLDEST.release:
        raise UnsupportedSetupError(
            f"vlmcp-patch needs transformers {OLDEST} or newer (tested: {TESTED}); transformers {version} is "
            f"installed. Upgrade it, e.g. pip install 'transformers{TESTED}'."
        )


def is_untested(version: str = transformers.__version__) -> bool:
    return Version(version).release[:2] > NEWEST.release[:2]


def warn_if_untested(version: str = transformers.__version__, unverified: dict | None = None) -> None:
    """One warning for a transformers newer than the tested releases, or one whose patch targets did not all
    verify (`unverified`: target -> (family, why), from `PatchSet.unverified`)."""
    if unverified:
        families = ", ".join(sorted({family or "every family" for family, _ in unverified.values()}))
        warnings.warn(
            f"vlmcp-patch: with transformers {version}, these patch targets did not verify: "
            f"{', '.join(unverified)}; the newest release vlmcp-patch was checked on is transformers {NEWEST}. "
            f"The models of their families ({families}) "
            "are left stock: with CP off they run exactly as stock, under CP their first forward raises. "
            "Everything else is patched.",
            UntestedVersionWarning,
            stacklevel=3,
        )
    elif is_untested(version):
        warnings.warn(
            f"vlmcp-patch was tested on transformers {TESTED}; transformers {version} is newer. Every patch target "
            "still verifies (signatures and pinned sources), so the patches are installed; report any difference "
            "you see.",
            UntestedVersionWarning,
            stacklevel=3,
        )
