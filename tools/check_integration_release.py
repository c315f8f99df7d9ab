"""Check releases of a training stack (accelerate, deepspeed, peft, trl) against the package's patch records, without
installing them.

    python tools/check_integration_release.py deepspeed 0.16.9 0.17.6 0.18.9 [--against 0.19.8] [--wheels DIR]

The sibling of tools/check_release.py (transformers): for each release it downloads the package's wheel, or its source
archive where there is none (DeepSpeed; `pip download --no-deps`, no install), and for every patch record of that
package that applies to the release (`Patch.since`) checks what the import checks (`patching.Patch.check`): the target
exists — followed through `from ... import` as the import resolves it —, its signature has the parameters the patch
relies on, and for code the package re-implements or rescales, its source digest is pinned. It prints each target's
digest, so that a release's digests can be pinned (docs/versions.md, "Adding a release"), and for a target that
changed a unified diff against `--against` (default: the first release given). Exit status 1 when any target changed.

The import resolves what the installed release has; this reads what the archive defines. A target imported from
another package (TRL's `gather`, from accelerate) is reported as such and not checked here.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from check_release import digest, parameters, records_applying

PACKAGES = ("accelerate", "deepspeed", "peft", "trl")


def patch_records(package: str, version: str) -> list:
    """The records of `package`'s targets that apply to `version` (`check_release.records_applying`)."""
    return records_applying(version, f"{package}.", requires=package)


def archive(package: str, version: str, directory: Path) -> Path:
    """The wheel (or, where there is none, the source archive) of `package==version` in `directory`, downloaded once."""
    stem = package.replace("-", "_")
    found = sorted([*directory.glob(f"{stem}-{version}-*.whl"), *directory.glob(f"{stem}-{version}.tar.gz")])
    if not found:
        # --no-build-isolation: a source archive's metadata is prepared with this environment's torch (DeepSpeed's
        # setup imports it), not a fresh one downloaded for that
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-build-isolation",
                        f"{package}=={version}", "-d", str(directory)], check=True)
        found = sorted([*directory.glob(f"{stem}-{version}-*.whl"), *directory.glob(f"{stem}-{version}.tar.gz")])
    return found[0]


class Sources:
    """The Python sources of one wheel or source archive, by module path, read on demand."""

    def __init__(self, path: Path):
        self.files: dict[str, bytes] = {}
        if path.suffix == ".whl":
            with zipfile.ZipFile(path) as z:
                self.files = {n: z.read(n) for n in z.namelist() if n.endswith(".py")}
        else:  # an sdist: <name>-<version>/<package>/...
            with tarfile.open(path) as t:
                for member in t.getmembers():
                    if member.isfile() and member.name.endswith(".py") and member.name.count("/") >= 1:
                        self.files[member.name.split("/", 1)[1]] = t.extractfile(member).read()
        self._trees: dict[str, tuple[list[str], ast.Module]] = {}

    def module(self, dotted: str):
        for name in (dotted.replace(".", "/") + ".py", dotted.replace(".", "/") + "/__init__.py"):
            if name in self.files:
                if name not in self._trees:
                    text = self.files[name].decode()
                    self._trees[name] = (text.splitlines(keepends=True), ast.parse(text))
                return (*self._trees[name], name.endswith("__init__.py"))
        return None

    def definition(self, target: str, depth: int = 0) -> tuple[str | None, ast.AST | None, str]:
        """(source as `inspect.getsource` gives it, its ast node, where) of a dotted target; the node None when it is
        absent, and `where` then says why."""
        parts = target.split(".")
        for split in range(len(parts) - 1, 0, -1):
            module_name = ".".join(parts[:split])
            found = self.module(module_name)
            if found is None:
                continue
            lines, node, is_package = found
            owner_class = None
            for i, name in enumerate(parts[split:]):
                if isinstance(node, ast.ClassDef) and name.startswith(f"_{node.name}__"):
                    name = name[len(node.name) + 1:]  # a name-mangled private method
                body = getattr(node, "body", [])
                owner, node = node, next((n for n in body if getattr(n, "name", None) == name), None)
                if node is None and isinstance(owner, ast.Module) and depth < 5:
                    source = _imported_from(owner, name, module_name, is_package)
                    if source is not None:
                        rest = ".".join([source[1], *parts[split + i + 1:]])
                        if self.module(source[0]) is None:
                            return None, None, f"imported from {source[0]} (another package: not checked here)"
                        return self.definition(f"{source[0]}.{rest}", depth + 1)
                if node is None:
                    return None, None, f"{name} is not defined in {module_name}"
                owner_class = owner if isinstance(owner, ast.ClassDef) else owner_class
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return None, node, "not a function"
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            return "".join(lines[start - 1: node.end_lineno]), node, f"{module_name.replace('.', '/')}.py:{start}"
        return None, None, "module not in the archive"


def _imported_from(module: ast.Module, name: str, module_name: str, is_package: bool) -> tuple[str, str] | None:
    """(module, name there) of a top-level `from X import name [as alias]` binding `name`; None when there is none."""
    for node in module.body:
        if not isinstance(node, ast.ImportFrom):
            continue
        for alias in node.names:
            if (alias.asname or alias.name) != name:
                continue
            if node.level:
                base = module_name.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module
            return source, alias.name
    return None


def check(patch, sources: Sources) -> tuple[list[str], str | None]:
    """(what no longer verifies for `patch` in `sources`, the target's digest where it has a source)."""
    source, node, where = sources.definition(patch.target)
    if where.startswith("imported from"):
        return [], None
    if node is None or source is None:
        return [f"missing: {where}"], None
    problems = []
    expects = getattr(patch, "expects", ())
    params = parameters(node)
    gone = [p for p in expects if not any(s in params for s in ((p,) if isinstance(p, str) else p))]
    if gone:
        problems.append(f"no longer takes {gone} ({where})")
    mirrors = getattr(patch, "mirrors", None)
    if mirrors is not None and digest(source) not in mirrors:
        problems.append(f"source changed: digest {digest(source)} is none of the pinned ({patch.checked_on}) ({where})")
    return problems, digest(source)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("package", choices=PACKAGES)
    parser.add_argument("versions", nargs="+")
    parser.add_argument("--against", help="the release to diff a changed target against (default: the first given)")
    parser.add_argument("--wheels", type=Path, default=Path.home() / ".cache" / "vlmcp-patch" / "wheels")
    args = parser.parse_args(argv)
    args.wheels.mkdir(parents=True, exist_ok=True)
    against = args.against or args.versions[0]
    failed = False
    for version in args.versions:
        sources = Sources(archive(args.package, version, args.wheels))
        records = patch_records(args.package, version)
        results = {p.target: check(p, sources) for p in records}
        changed = {t: problems for t, (problems, _) in results.items() if problems}
        print(f"{args.package} {version}: {len(records) - len(changed)} of {len(records)} patch targets verify")
        for target, (problems, found) in results.items():
            if getattr(next(p for p in records if p.target == target), "mirrors", None) is not None:
                print(f"  digest {found} {target}")
        for target, problems in changed.items():
            failed = True
            print(f"\nCHANGED {target}")
            for problem in problems:
                print(f"  {problem}")
            if version != against:
                old = Sources(archive(args.package, against, args.wheels))
                before, after = old.definition(target)[0] or "", sources.definition(target)[0] or ""
                print("".join(difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                                   f"{target} ({against})", f"{target} ({version})")))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
