"""The transformers versions this release supports, checked at import."""

from __future__ import annotations

import transformers
from packaging.version import Version

from .errors import UnsupportedSetupError

MINIMUM = Version("5.23.0")
BELOW = Version("5.24.0")  # 5.24 renames past_key_values to cache in the forwards patched here


def check_transformers_version(version: str = transformers.__version__) -> None:
    installed = Version(version)
    if not (MINIMUM <= installed < BELOW):
        raise UnsupportedSetupError(
            f"vlmcp-patch supports transformers >={MINIMUM},<{BELOW}; transformers {version} is installed. "
            f"Install a supported version, e.g. pip install 'transformers=={MINIMUM}'."
        )
