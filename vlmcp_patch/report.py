"""`python -m vlmcp_patch`: what is installed, what is patched and why, the CP layout of this launch (and, for a
model, how its heads split over each CP size), the optional kernels found, and a self-test of about ten seconds on
a tiny model (CPU)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
import time

import torch

from .launcher import NODE_SOURCES, launch
from .patching import cp_size
from .settings import SETTINGS
from .supported import supported_class_names

PACKAGES = ("torch", "transformers", "accelerate", "deepspeed", "trl", "peft")
KERNELS = {"flash-attn": "flash_attn", "flash-linear-attention": "fla", "causal-conv1d": "causal_conv1d"}


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def versions() -> list[str]:
    from . import __version__
    from .compat import TESTED, is_untested

    untested = " — newer than the tested releases" if is_untested() else ""
    lines = [f"vlmcp-patch {__version__} (tested on transformers {TESTED}{untested}); "
             f"Python {platform.python_version()}"]
    lines += [f"  {name:14s} {_version(name)}" for name in PACKAGES]
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU)"
    lines.append(f"  {'accelerator':14s} {gpu}")
    return lines


def kernels() -> list[str]:
    found = []
    for distribution, module in KERNELS.items():
        present = importlib.util.find_spec(module) is not None
        found.append(f"  {distribution:24s} {_version(distribution) if present else 'not found (torch path)'}")
    return found


def entry_lines() -> list[str]:
    """The entry without a line of code (`AUTOWRAPT_BOOTSTRAP=vlmcp_patch`): whether autowrapt, the variable and the
    package's entry point are there, and a warning where the variable is set but cannot act."""
    import os

    asked = "vlmcp_patch" in [g.strip() for g in os.environ.get("AUTOWRAPT_BOOTSTRAP", "").split(",")]
    installed = importlib.util.find_spec("autowrapt") is not None
    entry = any(e.name == "transformers" for e in importlib.metadata.entry_points(group="vlmcp_patch"))
    autowrapt = _version("autowrapt") if installed else 'not installed (pip install "vlmcp-patch[autowrapt]")'
    hook = "installed" if entry else "missing (reinstall the package)"
    lines = [f"  AUTOWRAPT_BOOTSTRAP=vlmcp_patch: {'set' if asked else 'not set'}; autowrapt: {autowrapt}",
             f"  the package's entry point `transformers` (group vlmcp_patch): {hook}"]
    if asked and not (installed and entry):
        lines.append("  WARNING: a program that does not import vlmcp_patch itself runs WITHOUT CP here")
    elif asked:
        lines.append("  every Python program of this environment imports vlmcp_patch after its first import of "
                     "transformers")
    return lines


def patches(status: list[dict]) -> list[str]:
    lines = []
    for entry in status:
        state = ("GUARD ONLY (stock; CP refused)" if entry["refused"] else "installed") if entry["applied"] else (
            "REFUSED" if entry["refused"] else None) or (
            f"for {entry['since']} only" if not entry["applies_here"] else
            f"waiting for `import {entry['requires']}`" if entry["requires"] else "not installed")
        pins = ", ".join(f"{digest} on {versions}" for digest, versions in (entry["mirrors"] or {}).items())
        pinned = f" [source pinned: {pins}]" if pins else ""
        if entry["refused"]:
            pinned += f"\n      refused: {entry['refused']}"
        lines.append(f"  {state:36s} {entry['target']}{pinned}\n      {entry['reason']}")
    return lines


def layout() -> list[str]:
    """The CP layout of this launch, from the launcher's environment (`launcher.launch`)."""
    here = launch()
    world, rank = here.world_size or 1, here.rank or 0
    size = cp_size()
    lines = [f"  VLMCP_CP_SIZE={SETTINGS.cp_size} (in effect: {size}), world size {world}, this rank {rank}"]
    if world % size:
        return lines + [f"  CP size {size} does not divide the world size {world}: the first CP forward will raise"]
    groups = [list(range(start, start + size)) for start in range(0, world, size)]
    shown = ", ".join(str(g) for g in groups[:4]) + (" ..." if len(groups) > 4 else "")
    lines.append(f"  CP groups (blocks of {size} consecutive ranks): {shown}")
    lines.append(f"  data-parallel replicas: {world // size}; this rank: replica {rank // size}, "
                 f"position {rank % size}")
    lines += node_lines(here)
    lines.append(f"  Ulysses size: {SETTINGS.ulysses_size or 'automatic, inside a node'} (VLMCP_ULYSSES_SIZE)")
    lines.append(f"  vision data parallelism: {'on' if SETTINGS.vision_dp else 'off'}")
    return lines


def node_lines(here) -> list[str]:
    """Ranks per node and which launcher's variable says so (`launcher.NODE_SOURCES`), as the CP groups' agreement
    will take it (`distributed.agree_on_node_size`); an outer launcher's variables, left out, are named."""
    stated = here.stated()
    sizes = {s.size for s in stated}
    if not stated:
        names = ", ".join(v.size for v in NODE_SOURCES)
        lines = [f"  ranks per node: no launcher states it ({names} not set)",
                 "  ... taken from the ranks' host names when the CP groups are created (one host: one node)"]
    elif len(sizes) > 1:
        stated_each = ", ".join(s.stated for s in stated)
        lines = [f"  ranks per node: the launchers disagree ({stated_each}): the first CP forward will raise"]
    else:
        lines = [f"  ranks per node: {sizes.pop()}, from {' and '.join(s.source for s in stated)}"]
    lines += [f"  {s.stated} left out: {s.left_out(here.world_size, here.rank)}" for s in here.statements
              if s not in stated]
    return lines


def model_layout(text_config, sizes, node_size: int | None = None) -> list[str]:
    """How a model's heads split at each CP size: U ranks exchange sequence for heads, R subgroups form a ring; with
    `node_size` (ranks per node), where the subgroups and rings fall on the nodes (`layout.ulysses_degree`)."""
    from .errors import UnsupportedSetupError
    from .attention.heads import has_deltanet, head_counts
    from .layout import node_spans, ulysses_degree

    heads = head_counts(text_config)
    described = f"{text_config.num_attention_heads} query heads"
    if has_deltanet(text_config):
        described += f", {text_config.linear_num_value_heads} DeltaNet value heads"
    nodes = f"nodes of {node_size} ranks" if node_size else "one node"
    override = f", VLMCP_ULYSSES_SIZE={SETTINGS.ulysses_size}" if SETTINGS.ulysses_size else ""
    lines = [f"  {described}; {nodes}{override}"]
    for size in sizes:
        try:
            ulysses = ulysses_degree(size, heads, node_size, SETTINGS.ulysses_size or None)
        except UnsupportedSetupError as error:
            lines.append(f"  P={size:<3d} refused: {error}")
            continue
        ring = size // ulysses
        how = "all-to-all only" if ring == 1 else f"a ring of {ring}" if ulysses == 1 else \
            f"all-to-all among {ulysses}, a ring of {ring}"
        if node_size and node_size % size:  # the group spans nodes (or straddles them)
            spans = node_spans(size, ulysses, node_size, world=size * node_size)
            where = [] if ulysses == 1 else [
                "all-to-all inside a node" if spans["ulysses_inside_node"] else "ALL-TO-ALL ACROSS NODES"]
            where += ["ring across nodes"] if spans["ring_crosses_nodes"] else []
            how += "".join(f"; {w}" for w in where)
        lines.append(f"  P={size:<3d} U={ulysses} x R={ring}  ({how})")
    return lines


def self_test() -> list[tuple[str, bool, str]]:
    """(name, passed, detail): P=1 bit-identity with stock, and a packed row against its samples one by one."""
    from . import apply, revert
    from .fixtures.data import Segment, make_batch, make_packed_batch
    from .fixtures.models import build_model, tiny_qwen3_vl_config

    torch.manual_seed(0)
    model = build_model(tiny_qwen3_vl_config(), seed=0)
    batch = make_batch([[Segment(text=5), Segment(image=(16, 24)), Segment(text=6)], [Segment(text=8)]], seed=1)

    def step(inputs):
        model.zero_grad(set_to_none=True)
        out = model(**inputs)
        out.loss.backward()
        return out.loss.detach(), out.logits.detach(), [p.grad.clone() for p in model.parameters()]

    ours = step(batch)
    revert()
    try:
        stock = step(batch)
    finally:
        apply()
    identical = torch.equal(ours[0], stock[0]) and torch.equal(ours[1], stock[1]) and all(
        torch.equal(a, b) for a, b in zip(ours[2], stock[2]))
    results = [("P=1 forward and backward bit-identical to stock transformers", identical, "")]

    row, alone = make_packed_batch([[Segment(text=4), Segment(image=(16, 16)), Segment(text=3)], [Segment(text=7)]],
                                   seed=2)
    with torch.no_grad():
        packed = model(**{k: v for k, v in row.items() if k != "labels"}).logits
        revert()
        try:
            separate = torch.cat([model(**{k: v for k, v in b.items() if k != "labels"}).logits for b in alone], 1)
        finally:
            apply()
    err = float((packed - separate).abs().max() / separate.abs().max())
    results.append(("packed row equals its samples run one by one (logits)", err <= 1e-5, f"rel. error {err:.1e}"))
    return results


def report(run_self_test: bool = True, text_config=None, name: str = "",
           node_size: int | None = None) -> tuple[str, bool]:
    """The report's text and whether the self-test passed; with `text_config` (of the model `name`), how its heads
    split at the CP size in effect and at 2 to 16 (and, with `node_size`, at multiples of it up to 8 nodes)."""
    from . import status

    lines = ["== versions", *versions(), "== optional kernels", *kernels(), "== CP without a line of code",
             *entry_lines(), "== CP layout of this launch", *layout()]
    if text_config is not None:
        sizes = sorted({cp_size(), *range(2, 17), *(node_size * n for n in range(1, 9) if node_size)} - {1})
        lines += [f"== {name}: Ulysses x ring by CP size", *model_layout(text_config, sizes, node_size)]
    lines += ["== supported models", "  " + ", ".join(supported_class_names()), "== patches", *patches(status())]
    ok = True
    if run_self_test:
        start = time.perf_counter()
        lines.append("== self-test (tiny Qwen3-VL, CPU)")
        for name, passed, detail in self_test():
            ok &= passed
            lines.append(f"  {'PASS' if passed else 'FAIL'}  {name}{'  (' + detail + ')' if detail else ''}")
        lines.append(f"  {time.perf_counter() - start:.1f} s")
    return "\n".join(lines), ok
