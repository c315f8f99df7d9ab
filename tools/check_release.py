"""Check a transformers release against the package's patch records, without installing it.

    python tools/check_release.py 5.26.0 [--wheels DIR] [--against 5.25.0]
    python tools/check_release.py 5.2.0..5.25.0      # every release between, as the registry lists them

Downloads the release's wheel (`pip download --no-deps`, into `--wheels`, default ~/.cache/vlmcp-patch/wheels) and,
for every patch target in transformers, reads the target's source from the wheel and checks what the import checks
(`patching.Patch.check`): that it exists, that its signature has the parameters the patch relies on, and — for code
the package re-implements — that its source digest is one of those pinned. For each target that changed it prints
what changed and a unified diff of its source against the newest release checked (`compat.NEWEST`, or
`--against`). Exit status: 0 when every target verifies, 1 otherwise.

Given several releases (`A..B`: every release from A to B that `pip index versions transformers` lists, or a list),
it checks each and prints a table, one row per release: how many targets verify and, for each re-implemented
source, which pinned digest it has (docs/versions.md keeps that table); then the changes, as above.

Adding a release (docs/versions.md): run this, adapt the family module where a target changed, pin the new digest
with the release it was checked on, run the tests.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def records_applying(version: str, prefix: str, requires: str | None = None) -> list:
    """The package's patch records of targets under `prefix` (and, given, with `requires`) that apply to `version`
    (`Patch.since`). The package is imported with VLMCP_DISABLE=1 (the records only: nothing is patched) unless it
    already was; the variable is put back, so the processes a caller starts later see the environment it had."""
    previous = os.environ.get("VLMCP_DISABLE")
    os.environ["VLMCP_DISABLE"] = "1"
    try:
        import vlmcp_patch
        from vlmcp_patch.patching import Patch, applies_here
    finally:
        if previous is None:
            os.environ.pop("VLMCP_DISABLE")
        else:
            os.environ["VLMCP_DISABLE"] = previous
    return [p for p in vlmcp_patch.PATCHES.patches if isinstance(p, Patch) and p.target.startswith(prefix)
            and (requires is None or p.requires == requires) and applies_here(p, version)]


def patch_records(version: str) -> list:
    """The records of transformers targets that apply to `version` (`records_applying`)."""
    return records_applying(version, "transformers.")


def newest_checked() -> str:
    from vlmcp_patch.compat import NEWEST

    return str(NEWEST)


def wheel(version: str, directory: Path) -> Path:
    """The transformers wheel of `version` in `directory`, downloaded once (no install, no dependencies)."""
    found = sorted(directory.glob(f"transformers-{version}-*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
                        f"transformers=={version}", "-d", str(directory)], check=True)
        found = sorted(directory.glob(f"transformers-{version}-*.whl"))
    return found[0]


INHERITED = "inherited"  # `Release.definition` of a class attribute defined in a base, not in the class's body


class Release:
    """The source files of one transformers wheel, read on demand."""

    def __init__(self, path: Path):
        self.zip = zipfile.ZipFile(path)
        self.names = set(self.zip.namelist())
        self._trees: dict[str, tuple[list[str], ast.Module]] = {}

    def module(self, dotted: str) -> tuple[list[str], ast.Module] | None:
        name = dotted.replace(".", "/") + ".py"
        if name not in self.names:
            return None
        if name not in self._trees:
            text = self.zip.read(name).decode()
            self._trees[name] = (text.splitlines(keepends=True), ast.parse(text))
        return self._trees[name]

    def definition(self, target: str) -> tuple[str | None, ast.AST | None, str]:
        """(source as `inspect.getsource` gives it, its ast node, where) of a dotted target; None when absent."""
        parts = target.split(".")
        for split in range(len(parts) - 1, 0, -1):
            found = self.module(".".join(parts[:split]))
            if found is None:
                continue
            lines, node = found
            for i, name in enumerate(parts[split:]):
                body = getattr(node, "body", [])
                owner, node = node, next((n for n in body if getattr(n, "name", None) == name), None)
                if node is None and isinstance(owner, ast.ClassDef) and split + i == len(parts) - 1:
                    return None, owner, INHERITED  # the class exists; the attribute comes from a base
                if node is None:
                    return None, None, f"{name} is not defined in {'.'.join(parts[:split])}"
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return None, node, "not a function"
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            return "".join(lines[start - 1 : node.end_lineno]), node, f"{'/'.join(parts[:split])}.py:{start}"
        return None, None, "module not in the wheel"


def digest(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def parameters(node: ast.AST) -> set[str]:
    args = node.args
    return {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}


def check(patch, new: Release) -> list[str]:
    """What no longer verifies for `patch` in the release `new` (empty: it verifies)."""
    source, node, where = new.definition(patch.target)
    if where == INHERITED and not patch.expects and patch.mirrors is None:
        return []  # a method the class inherits (a layer's `__call__`): the patch relies on nothing of its source
    if node is None or source is None:
        return [f"missing: {where}"]
    problems = []
    params = parameters(node)
    gone = [p for p in patch.expects if not any(s in params for s in ((p,) if isinstance(p, str) else p))]
    if gone:
        problems.append(f"no longer takes {gone} ({where})")
    if patch.mirrors is not None and digest(source) not in patch.mirrors:
        problems.append(f"source changed: digest {digest(source)} is none of the pinned ({patch.checked_on}) ({where})")
    return problems


def diff(target: str, old: Release, new: Release, old_version: str, new_version: str) -> str:
    before, after = old.definition(target)[0] or "", new.definition(target)[0] or ""
    return "".join(difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                        f"{target} ({old_version})", f"{target} ({new_version})"))


def releases_between(first: str, last: str) -> list[str]:
    """Every final transformers release from `first` to `last` (both included) that the registry lists, oldest
    first (`pip index versions`, the ordinary client)."""
    from packaging.version import Version

    listed = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "transformers"], check=True,
                            capture_output=True, text=True).stdout
    line = next(line for line in listed.splitlines() if line.startswith("Available versions:"))
    versions = sorted(Version(v.strip()) for v in line.split(":", 1)[1].split(","))
    return [str(v) for v in versions if Version(first) <= v <= Version(last) and not v.is_prerelease]


def expand(specs: list[str]) -> list[str]:
    """The releases named: `X.Y.Z` each, `A..B` every release between."""
    return [v for spec in specs for v in (releases_between(*spec.split("..")) if ".." in spec else [spec])]


def pinned_sources(records: list) -> dict[str, list]:
    """The re-implemented sources, one column per pinned set of digests (a family and its MoE twin share one):
    column name -> its records."""
    columns: dict[str, list] = {}
    for patch in records:
        if patch.mirrors:
            name = next((n for n, ps in columns.items() if ps[0].mirrors is patch.mirrors), None)
            columns.setdefault(name or ".".join(patch.target.split(".")[-2:]), []).append(patch)
    return columns


def table_row(version: str, release: Release, records: list, columns: dict[str, list], changed: dict) -> str:
    """One release's row: targets verifying, then each column's digest(s) (`?` marks one no record pins)."""
    cells, here = [], {p.target for p in records}
    for patches in columns.values():
        sources = [release.definition(p.target)[0] for p in patches if p.target in here]
        found = dict.fromkeys(digest(source) if source else "missing" for source in sources)
        cells.append(" / ".join(d if d == "missing" else f"`{d}`" + ("" if any(d in p.mirrors for p in patches)
                                                                      else " ?") for d in found))
    return f"| {version} | {len(records) - len(changed)} of {len(records)} | " + " | ".join(cells) + " |"


def check_releases(versions: list[str], wheels: Path) -> dict[str, tuple[Release, dict]]:
    """Each release's wheel and what changed in it (target -> problems), printing one table row per release."""
    columns = pinned_sources(patch_records(versions[-1]))
    if len(versions) > 1:
        print("| release | targets verifying | " + " | ".join(columns) + " |")
        print("|---" * (len(columns) + 2) + "|")
    results = {}
    for version in versions:
        release, records = Release(wheel(version, wheels)), patch_records(version)
        changed = {p.target: problems for p in records if (problems := check(p, release))}
        results[version] = (release, changed)
        if len(versions) > 1:
            print(table_row(version, release, records, columns, changed))
        else:
            print(f"transformers {version}: {len(records) - len(changed)} of {len(records)} patch targets verify")
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("versions", nargs="+", metavar="version", help="X.Y.Z, or A..B for every release between")
    parser.add_argument("--against", help="the release to diff against (default: the newest checked)")
    parser.add_argument("--wheels", type=Path, default=Path.home() / ".cache" / "vlmcp-patch" / "wheels")
    args = parser.parse_args(argv)
    args.wheels.mkdir(parents=True, exist_ok=True)
    results = check_releases(expand(args.versions), args.wheels)
    if not any(changed for _, changed in results.values()):
        return 0
    args.against = args.against or newest_checked()
    old = Release(wheel(args.against, args.wheels))
    for version, (new, changed) in results.items():
        for target, problems in changed.items():
            print(f"\nCHANGED in {version}: {target}")
            for problem in problems:
                print(f"  {problem}")
            print(diff(target, old, new, args.against, version) or "  (the same source as in the release diffed)")
    return 1


if __name__ == "__main__":
    sys.exit(main())
