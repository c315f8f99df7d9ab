"""`python -m vlmcp_patch [--no-self-test]`: versions, patches, the CP layout of this launch, kernels, self-test."""

from __future__ import annotations

import argparse
import sys

from .report import report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vlmcp_patch", description=__doc__)
    parser.add_argument("--no-self-test", action="store_true", help="skip the ten-second self-test")
    args = parser.parse_args(argv)
    text, ok = report(run_self_test=not args.no_self_test)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
