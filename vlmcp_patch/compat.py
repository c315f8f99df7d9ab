"""The transformers versions this release supports, checked at import."""

from __future__ import annotations

import warnings

import transformers
from packaging.version import Version

from .errors import UnsupportedSetupError

MINIMUM = Version("5.23.0")
BELOW = Version("6.0.0")
TESTED = ("5.23",)


def check_transformers_version(version: str = transformers.__version__) -> None:
    installed = Version(version)
    if not (MINIMUM <= installed < BELOW):
        raise UnsupportedSetupError(
            f"vlmcp-patch supports transformers >={MINIMUM},<{BELOW}; transformers {version} is installed. "
            f"Install a supported version, e.g. pip install 'transformers=={MINIMUM}'."
        )
    if f"{installed.major}.{installed.minor}" not in TESTED:
        warnings.warn(
            f"vlmcp-patch was tested with transformers {', '.join(TESTED)}.x; {version} is installed. Its patch "
            "targets are checked at import, and any drift raises an error naming the target.",
            stacklevel=3,
        )
