"""Per-rank memory of one training step (forward + backward) at P = 1, 2, 4, 8, with the released models' per-token
proportions, on a packed row of a given length: the step's peak and the longest row that fits a memory budget.

    python -m benchmarks.memory [--model qwen3-vl|qwen3.5] [--sample text-heavy|image-heavy|video]
        [--tokens 8192] [--layers 12] [--scale 16] [--gradient-checkpointing] [--sizes 1 2 4 8] [--step sft|grpo]
        [--stock] [--heads 4] [--loops host device] [--mlp-tile-tokens auto|0|N]
        [--vision-tile-patches auto|0|N] [--offload-checkpoints [--offload-features auto|on|off]] [--vision-tiles-compare] [--loss-chunk-tokens N]
        [--no-recompute-norms]
    python -m benchmarks.memory --longest 400 [--sample ...] [--gradient-checkpointing]   # MiB per rank

The model has the released model's vocabulary, heads and widths divided by `--scale` (1: the released widths;
16: a sixteenth, so that long rows run on a CPU) and the patch side by its square root, so a pixel row keeps its
proportion to a hidden state; `--layers` decoder layers, three vision blocks (three deepstack levels). Rows are
samples of the chosen kind packed into one row (a packed row takes the package's path at P=1 too: P=1 is the
package's own baseline) and filled up to exactly `--tokens` with text:

* text-heavy — samples of ~1,000 tokens, one picture each (6% vision tokens);
* image-heavy — samples of four pictures of mixed sizes and little text (~90% vision tokens);
* video — samples of one 16-frame video (temporal patch groups) and a question (~95% vision tokens).

Memory is counted on the CPU as a GPU would hold it. The step's peak is the peak of live bytes of every tensor
storage created during forward + backward (`LiveBytes`: a dispatch mode that sees each allocation and its
release), the parameter gradients left out (they do not depend on P). Each P runs the step for two kinds of
training loop (`--loops`, both by default; one process, a fresh count each):

* host — the training integrations' loop (HF Trainer, TRL, Accelerate, `vlmcp_patch.batch_to_device`): under
  CP the pixel values stay on the host and each rank copies its share to its device in the forward. Added to
  the peak is what the batch occupies on the device during the whole step: at P=1 (and for stock) every tensor
  of the batch; under CP its integer tensors only (ids, labels, positions, grids). The share's copy is made inside
  the step, so it is in the peak already: on this CPU the host is the device, so `HostPixels` turns each rank's
  `.to(device)` of its pixel share into the copy a GPU makes;
* device — the loop most people write, `batch = {k: v.to(device) ...}`: the whole batch, pixels included, is on
  the device before the step, on every rank. It is the caller's, the same at every P, and left out on both sides:
  the peak is what the step adds (a rank's pixel share is then a view).

It prints, for the busiest rank and each loop, that peak and R = P x peak(rank) / peak(P=1) (1.0: a perfect 1/P
split), the bytes in the host pool of `--offload-checkpoints` (on the host, not in the device peak: its buffers are
left out of it, and so are the vision features the offload parks on the host and their gradients there, whose moves
to the device `HostPixels` turns into copies as for the pixels), and for the host loop the bytes autograd saves for backward (the caller's batch left out), the
vision patches the rank encoded against a perfect split, the tokens it held, and the step's wall-clock; then each
rank's device peak and host pool; with `--stock`,
stock transformers on the same row beside P=1 (its sdpa builds an S x S mask for a packed row: slow on long rows).

`--longest MIB` grows the row at each P until the busiest rank's peak crosses MIB (doubling, then bisecting to
within 2%; every probe a real step, the first of `--loops`) and prints the longest row that fits and its ratio to
P=1's.
`--vision-tiles-compare` runs each P twice, the vision tower untiled (`--vision-tile-patches 0`) and in tiles
(`--vision-tile-patches`, auto by default), and prints the busiest rank's device peak and host pool of each and
their ratio.
`--dry-run`: the tiny test models on short rows (seconds).
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from torch.overrides import TorchFunctionMode

from benchmarks.common import (
    MIB,
    MODELS,
    LiveBytes,
    ModuleStack,
    SavedTensors,
    build_benchmark_model,
    real_image_processor,
    timed,
)
from tests.helpers.harness import run_distributed
from vlmcp_patch.fixtures.data import Segment, make_packed_batch

NOT_SHRINKING = 1.2
LOOPS = ("host", "device")
PIXEL_KEYS = ("pixel_values", "pixel_values_videos")
S = Segment
# One sample of each kind, pictures sized for a patch-16 tower (scaled with the patch, so the token counts stay).
PATTERNS = {
    "text-heavy": [S(text=700), S(image=(256, 256)), S(text=240)],
    "image-heavy": [S(text=12), S(image=(384, 384)), S(text=6), S(image=(224, 224)), S(text=6),
                    S(image=(384, 256)), S(text=6), S(image=(448, 256)), S(text=20)],
    "video": [S(text=24), S(video=(16, 256, 192)), S(text=40)],
}


def _scaled(segment: Segment, patch: int) -> Segment:
    side = lambda px: px * patch // 16  # noqa: E731 - the same patch grid at another patch size
    if segment.image is not None:
        return S(image=(side(segment.image[0]), side(segment.image[1])))
    if segment.video is not None:
        groups, width, height = segment.video
        return S(video=(groups, side(width), side(height)))
    return segment


def row_of(sample: str, tokens: int, patch: int, tiny: bool = False) -> dict:
    """A packed row of exactly `tokens` tokens: samples of `sample`'s kind, the rest one text sample."""
    from vlmcp_patch.fixtures.data import image_processor

    pattern = [S(text=20), S(image=(16, 24)), S(text=12)] if tiny else [_scaled(s, patch) for s in PATTERNS[sample]]
    processor = image_processor() if tiny else real_image_processor(patch)
    one = make_packed_batch([pattern], seed=0, processor=processor)[0]["input_ids"].shape[1]
    count = max(0, tokens - 1) // one
    layout = [pattern] * count + ([[S(text=tokens - count * one)]] if tokens > count * one else [])
    return make_packed_batch(layout, seed=0, processor=processor)[0]


def batch_device_bytes(batch: dict, cp_size: int, loop: str) -> int:
    """What the caller's batch occupies on a rank's device during the step, as counted (module docstring): nothing
    for the device loop (left out on both sides); for the host loop every tensor at P=1, the integer ones under
    CP."""
    if loop == "device":
        return 0
    return sum(t.numel() * t.element_size() for k, t in batch.items()
               if torch.is_tensor(t) and (cp_size == 1 or not t.is_floating_point()))


class HostPixels(TorchFunctionMode):
    """The host loop on a CPU: a `.to(...)` of (a view of) the batch's pixel values copies, as the move from the host
    to a GPU does; everything else runs as it is."""

    def __init__(self, batch: dict):
        super().__init__()
        self.storages = {batch[k].untyped_storage().data_ptr() for k in PIXEL_KEYS if torch.is_tensor(batch.get(k))}

    def add(self, tensor: torch.Tensor) -> None:
        """A host tensor the package made (a parked vision feature): its moves to the device copy too."""
        self.storages.add(tensor.untyped_storage().data_ptr())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to and args and args[0].untyped_storage().data_ptr() in self.storages:
            kwargs = {**kwargs, "copy": True}
        return func(*args, **kwargs)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _model(args: argparse.Namespace):
    dtype = DTYPES[getattr(args, "dtype", "fp32")]
    if not args.dry_run:
        heads = {"heads": args.heads} if args.heads else {}
        return build_benchmark_model(args.model, layers=args.layers, scale=args.scale, **heads).to(dtype)
    from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_5_config, tiny_qwen3_vl_config

    config = (tiny_qwen3_vl_config if args.model == "qwen3-vl" else tiny_qwen3_5_config)(num_attention_heads=8)
    return build_model(config, seed=0).to(dtype)


def _in_dtype(batch: dict, args: argparse.Namespace) -> dict:
    """The batch's floating tensors (the pixels) in the benchmark's dtype, as a bf16 training run hands them over."""
    dtype = DTYPES[getattr(args, "dtype", "fp32")]
    return {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in batch.items()}


def measure(rank: int, world_size: int, args: argparse.Namespace, tokens: int, stock: bool = False) -> dict:
    """One forward + backward of the row on this rank (`grpo`: a GRPO scoring step, policy and reference) for each
    loop of `args.loops`: {loop: peak bytes (the batch as counted for that loop), saved bytes by module, vision
    patches encoded, tokens held, time}."""
    import vlmcp_patch

    torch.manual_seed(0)
    model = _model(args)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    reference = _model(args).requires_grad_(False) if args.step == "grpo" else None
    batch = _in_dtype(row_of(args.sample, tokens, model.config.vision_config.patch_size, args.dry_run), args)
    if stock:
        vlmcp_patch.revert()
    # the switches as asked under CP, whatever the row needs; P=1 is the untiled baseline (explicit switches would act
    # there too: `vlmcp_patch/by_need.py`)
    cp = world_size > 1
    vlmcp_patch.enable(cp_size=world_size, mlp_tile_tokens=args.mlp_tile_tokens if cp else "auto",
                       vision_tile_patches=args.vision_tile_patches if cp else "auto",
                       offload_checkpoints=args.offload_checkpoints,
                       offload_features={"auto": "auto", "on": True, "off": False}[args.offload_features],
                       loss_chunk_tokens=getattr(args, "loss_chunk_tokens", None),
                       recompute_norms=not getattr(args, "no_recompute_norms", False) if cp else "auto")
    results = {}
    for loop in args.loops:
        model.zero_grad(set_to_none=True)  # each loop's step allocates its gradients anew
        results[loop] = _one_step(model, reference, batch, args, loop, world_size, stock)
    return results


def _one_step(model, reference, batch: dict, args, loop: str, world_size: int, stock: bool) -> dict:
    """One counted step of `measure` for `loop` (module docstring)."""
    from vlmcp_patch.offload import HOST_CHECKPOINTS, HOST_FEATURES
    from vlmcp_patch.stats import STATS
    from vlmcp_patch.vision_tiles import VISION_TILES

    STATS.drain()
    VISION_TILES.drain()
    inputs = [v for v in batch.values() if torch.is_tensor(v)]
    modules = ModuleStack(model)
    saved = SavedTensors(model, modules, inputs)
    weights = [*model.parameters(), *model.buffers(), *(reference.parameters() if reference is not None else ())]
    live = LiveBytes([*weights, *inputs])
    host = HostPixels(batch) if loop == "host" and world_size > 1 else contextlib.nullcontext()
    parked: set[int] = set()  # the vision features parked on the host and their gradients there (`park_features`)

    def on_host(tensor: torch.Tensor) -> None:
        parked.update(live.ids_of([tensor]))
        if isinstance(host, HostPixels):
            host.add(tensor)

    def step():
        HOST_FEATURES.observers.append(on_host)
        try:
            with modules, saved.recording(), live, host:
                loss = model(**batch).loss if reference is None else grpo_scoring_loss(model, reference, batch)
                loss.backward()
        finally:
            HOST_FEATURES.observers.remove(on_host)
        return loss

    _, seconds = timed(step)
    tiles = VISION_TILES.drain()
    facts = STATS.drain()  # per vision pass (a GRPO step encodes the pictures twice: reference and policy)
    grads = live.ids_of(p.grad for p in model.parameters())
    host_pool = live.ids_of(HOST_CHECKPOINTS.pool.slabs.values())  # on the host, not the device (all free again after backward)
    patches = sum(int(batch[k].prod(-1).sum()) for k in ("image_grid_thw", "video_grid_thw") if k in batch)
    return {
        "saved": saved.total,
        "saved_by_module": dict(saved.by_module),
        "peak": live.peak(excluded=grads | host_pool | parked)
        + batch_device_bytes(batch, 1 if stock else world_size, loop),
        "host": HOST_CHECKPOINTS.pool.reserved,
        "vision_patches": facts.get("cp_vision_patches_per_rank", patches),
        "all_patches": patches,
        "tokens_per_rank": facts.get("cp_tokens_per_rank", batch["input_ids"].shape[1]),
        "tokens": batch["input_ids"].shape[1],
        "seconds": seconds,
        "vision_tiles_per_call": tiles["forward_tiles"] / tiles["calls"] if tiles["calls"] else 1.0,
    }


def completion_targets(batch: dict, share: float = 0.25) -> torch.Tensor:
    """GRPO scores the completion: the last `share` of each sample's tokens are its targets (-100 elsewhere)."""
    targets = torch.full_like(batch["input_ids"], -100)
    starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist() + [batch["input_ids"].shape[1]]
    for a, b in zip(starts[:-1], starts[1:]):
        first = b - max(1, int((b - a) * share))
        targets[0, first - 1 : b - 1] = batch["input_ids"][0, first:b]
    return targets


def grpo_scoring_loss(model, reference, batch: dict, beta: float = 0.04) -> torch.Tensor:
    """What a GRPO step computes on one batch: the reference's log-probabilities of the completion tokens (no
    gradient), the policy's (with it), and the clipped-ratio loss with a KL term, per token."""
    import vlmcp_patch

    targets = completion_targets(batch)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        ref = vlmcp_patch.token_log_probs(reference, targets=targets, **inputs).log_probs
    out = vlmcp_patch.token_log_probs(model, targets=targets, **inputs)
    scored = (targets != -100).float()
    advantage = torch.linspace(-1, 1, scored.shape[1])[None]
    ratio = torch.exp(out.log_probs - out.log_probs.detach())
    kl = torch.exp(ref - out.log_probs) - (ref - out.log_probs) - 1
    return ((-ratio * advantage + beta * kl) * scored).sum() / scored.sum()


def _busiest(per_rank: list[dict], key: str) -> float:
    return max(r[key] for r in per_rank)


def _layer_kind(name: str) -> str:
    """Group the modules of all layers: layers.3.self_attn -> layers.*.self_attn."""
    return ".".join("*" if p.isdigit() else p for p in name.split("."))


def not_shrinking(reference: dict, per_rank: list[dict], size: int) -> list[tuple[str, float, float, float]]:
    """(module kind, MiB at P=1, MiB on the busiest rank, P x rank / P=1) of the saved bytes that do not shrink."""
    def by_kind(result):
        out = {}
        for name, n in result["saved_by_module"].items():
            out[_layer_kind(name)] = out.get(_layer_kind(name), 0) + n
        return out

    base = by_kind(reference)
    ranks = [by_kind(r) for r in per_rank]
    rows = []
    for kind in sorted(set(base) | {k for r in ranks for k in r}):
        mine = max(r.get(kind, 0) for r in ranks)
        ratio = size * mine / base[kind] if base.get(kind) else float("inf")
        if ratio > NOT_SHRINKING and mine > 0.001 * reference["saved"]:
            rows.append((kind, base.get(kind, 0) / MIB, mine / MIB, ratio))
    return rows


def _run(args, size: int, tokens: int, stock: bool = False) -> list[dict]:
    """Per rank: {loop: its step's result} (`measure`)."""
    return run_distributed(measure, size, args, tokens, stock, timeout=7200)


def _of(per_rank: list[dict], loop: str) -> list[dict]:
    return [r[loop] for r in per_rank]


def peak_table(args) -> None:
    first, others = args.loops[0], args.loops[1:]
    stock = _run(args, 1, args.tokens, stock=True)[0][first] if args.stock and args.step == "sft" else None
    runs = {p: _run(args, p, args.tokens) for p in args.sizes}
    base = min(runs)
    results = {p: _of(per_rank, first) for p, per_rank in runs.items()}
    reference = results[base][0]
    heads = f", {args.heads} query heads" if args.heads else ""
    print(f"{args.model} ({args.layers} layers, widths / {args.scale}{heads}), {args.sample}, "
          f"{'gradient checkpointing' if args.gradient_checkpointing else 'no checkpointing'}, step {args.step}: "
          f"{reference['tokens']} tokens, {reference['all_patches']} vision patches; loops: {', '.join(args.loops)} "
          "(the first one's peak, R and saved bytes first)")
    other_headers = "".join(f" {loop + ' MiB':>11} {'R ' + loop:>8}" for loop in others)
    print(f"{'P':>9} {'peak MiB':>9} {'R peak':>7}" + other_headers
          + f" {'host MiB':>9} {'saved MiB':>10} {'R saved':>8} {'patches':>8} {'patch ratio':>11} {'tokens/rank':>11}"
          f" {'step s':>7}")
    if stock is not None:
        print(f"{'1 stock':>9} {stock['peak'] / MIB:>9.1f} {'':>7}" + "".join(f" {'':>11} {'':>8}" for _ in others)
              + f" {'':>9} {stock['saved'] / MIB:>10.1f} {'':>8} {stock['vision_patches']:>8.0f} {'':>11} "
              f"{stock['tokens_per_rank']:>11.0f} {stock['seconds']:>7.1f}")
    for size, per_rank in results.items():
        peak, saved = _busiest(per_rank, "peak"), _busiest(per_rank, "saved")
        patches = _busiest(per_rank, "vision_patches")
        patch_ratio = size * patches / reference["all_patches"] if reference["all_patches"] else float("nan")
        other_columns = ""
        for loop in others:
            mine, theirs = _busiest(_of(runs[size], loop), "peak"), _busiest(_of(runs[base], loop), "peak")
            other_columns += f" {mine / MIB:>11.1f} {size * mine / theirs:>8.3f}"
        print(f"{size:>9} {peak / MIB:>9.1f} {size * peak / reference['peak']:>7.3f}{other_columns} "
              f"{_busiest(per_rank, 'host') / MIB:>9.1f} {saved / MIB:>10.1f} {size * saved / reference['saved']:>8.3f} {patches:>8.0f} {patch_ratio:>11.3f} "
              f"{_busiest(per_rank, 'tokens_per_rank'):>11.0f} {_busiest(per_rank, 'seconds'):>7.1f}")
    for size, per_rank in results.items():
        ranks = ", ".join(f"{r['peak'] / MIB:.1f} / {r['host'] / MIB:.1f}" for r in per_rank)
        print(f"per rank at P={size} (device peak / host pool MiB): {ranks}")
    for size, per_rank in results.items():
        print(f"split: P={size} -> {_busiest(per_rank, 'tokens_per_rank'):.0f} tokens per rank of "
              f"{reference['tokens']}")
    for size, per_rank in results.items():
        if size == base:
            continue
        rows = not_shrinking(reference, per_rank, size)
        print(f"saved tensors that do not shrink at P={size} (P x busiest rank > {NOT_SHRINKING} x P=1):"
              + ("" if rows else " none"))
        for kind, base_mib, mine, ratio in rows:
            print(f"  {kind:60s} P=1 {base_mib:8.2f} MiB  rank {mine:8.2f} MiB  ratio {ratio:5.2f}")


def vision_tiles_table(args) -> None:
    """At each P: the busiest rank's device peak and host pool with the vision tower untiled and in tiles."""
    first = args.loops[0]
    print(f"{args.model} ({args.layers} layers, widths / {args.scale}), {args.sample}, "
          f"{'gradient checkpointing' if args.gradient_checkpointing else 'no checkpointing'}"
          f"{', checkpoints offloaded' if args.offload_checkpoints else ''}, loop {first}: {args.tokens} tokens; "
          f"the vision tower untiled and in tiles ({args.vision_tile_patches} patches per tile)")
    print(f"{'P':>3} {'untiled MiB':>12} {'tiled MiB':>10} {'ratio':>6} {'host untiled':>13} {'host tiled':>11} "
          f"{'patches/rank':>12} {'tiles/call':>10}")
    for size in args.sizes:
        peaks = {}
        for tiles in (0, args.vision_tile_patches):
            run_args = argparse.Namespace(**{**vars(args), "vision_tile_patches": tiles})
            peaks[tiles] = _of(_run(run_args, size, args.tokens), first)
        untiled, tiled = peaks[0], peaks[args.vision_tile_patches]
        a, b = _busiest(untiled, "peak"), _busiest(tiled, "peak")
        print(f"{size:>3} {a / MIB:>12.1f} {b / MIB:>10.1f} {b / a:>6.3f} {_busiest(untiled, 'host') / MIB:>13.1f} "
              f"{_busiest(tiled, 'host') / MIB:>11.1f} {_busiest(tiled, 'vision_patches'):>12.0f} "
              f"{_busiest(tiled, 'vision_tiles_per_call'):>10.1f}", flush=True)


def longest_row(args, size: int, budget: int) -> tuple[int, float]:
    """(longest row whose busiest-rank peak stays within `budget` bytes, its peak): doubling, then bisecting."""
    def fits(tokens):
        peak = _busiest(_of(_run(args, size, tokens), args.loops[0]), "peak")
        print(f"  P={size} {tokens:>7} tokens: peak {peak / MIB:8.1f} MiB {'fits' if peak <= budget else 'over'}",
              flush=True)
        return peak <= budget, peak

    low, high, low_peak = 0, args.start * size, 0.0
    while True:
        ok, peak = fits(high)
        if not ok:
            break
        low, high, low_peak = high, 2 * high, peak
    while high - low > max(32, 0.02 * high):
        middle = (low + high) // 2
        ok, peak = fits(middle)
        low, high, low_peak = (middle, high, peak) if ok else (low, middle, low_peak)
    return low, low_peak


def longest_table(args) -> None:
    budget = args.longest * MIB
    found = {size: longest_row(args, size, budget) for size in args.sizes}
    base = found[min(found)][0]
    print(f"{args.model} ({args.layers} layers, widths / {args.scale}), {args.sample}, "
          f"{'gradient checkpointing' if args.gradient_checkpointing else 'no checkpointing'}: the longest row "
          f"within {args.longest} MiB per rank")
    print(f"{'P':>3} {'tokens':>8} {'peak MiB':>9} {'ratio to P=1':>13} {'/ P':>6}")
    for size, (tokens, peak) in found.items():
        ratio = tokens / base if base else float("nan")
        print(f"{size:>3} {tokens:>8} {peak / MIB:>9.1f} {ratio:>13.2f} {ratio / size:>6.2f}")


def parser() -> argparse.ArgumentParser:
    """The benchmark's options (`benchmarks.plan_measure` builds its runs' options from them too)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-vl", choices=list(MODELS))
    parser.add_argument("--sample", default="image-heavy", choices=list(PATTERNS))
    parser.add_argument("--tokens", type=int, default=8192, help="the row's length")
    parser.add_argument("--layers", type=int, default=12, help="decoder layers")
    parser.add_argument("--scale", type=int, default=16, choices=[1, 4, 16], help="widths divided by this")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="non-reentrant, layers and vision")
    parser.add_argument("--heads", type=int, help="Qwen3-VL's query heads (half as many KV heads), e.g. 4: P=8 then "
                        "runs as 4 x a ring of 2")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--step", default="sft", choices=["sft", "grpo"],
                        help="sft: the loss of every token; grpo: a GRPO scoring step (policy and reference "
                        "log-probabilities of the completion tokens, vlmcp_patch.token_log_probs)")
    parser.add_argument("--stock", action="store_true", help="also stock transformers at P=1 on the same row")
    parser.add_argument("--longest", type=float, help="MiB per rank: the longest row that fits, at each P")
    parser.add_argument("--start", type=int, default=1024, help="--longest: the first probe, tokens per rank")
    parser.add_argument("--loops", nargs="+", default=list(LOOPS), choices=LOOPS,
                        help="host: the integrations' loop, pixel values on the host under CP; device: the whole "
                        "batch moved to the device by the caller (module docstring)")
    parser.add_argument("--mlp-tile-tokens", default="on", type=lambda v: v if v in ("auto", "on") else int(v),
                        help="tokens per tile of the MLPs under CP (on: sized automatically, auto: by need, or 0: "
                        "untiled; VLMCP_MLP_TILE_TOKENS)")
    parser.add_argument("--vision-tile-patches", default="on", type=lambda v: v if v in ("auto", "on") else int(v),
                        help="patches per tile of the vision tower under CP (on: sized automatically, auto: by "
                        "need, or 0: untiled; VLMCP_VISION_TILE_PATCHES)")
    parser.add_argument("--vision-tiles-compare", action="store_true",
                        help="each P with the vision tower untiled and in tiles: peaks and their ratio")
    parser.add_argument("--offload-features", choices=["auto", "on", "off"], default="auto",
                        help="under CP, the vision features wait on the host (VLMCP_OFFLOAD_FEATURES; auto: by need)")
    parser.add_argument("--offload-checkpoints", action="store_true",
                        help="the checkpoints in host memory (VLMCP_OFFLOAD_CHECKPOINTS; with --gradient-checkpointing)")
    parser.add_argument("--loss-chunk-tokens", type=int,
                        help="tokens per chunk of the fused head (default VLMCP_LOSS_CHUNK, else its automatic rule): "
                        "a small chunk leaves the peak to the recomputed layer")
    parser.add_argument("--no-recompute-norms", action="store_true",
                        help="the RMSNorms keep their fp32 intermediates under CP (VLMCP_RECOMPUTE_NORMS=0)")
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES),
                        help="the weights' and pixels' dtype (bf16: as a GPU trains; the head's logits stay fp32)")
    parser.add_argument("--dry-run", action="store_true", help="the tiny test models on short rows")
    return parser


def main() -> None:
    args = parser().parse_args()
    if args.dry_run:
        args.tokens, args.layers, args.start = min(args.tokens, 150), 2, 64
    if args.vision_tiles_compare:
        vision_tiles_table(args)
    elif args.longest:
        longest_table(args)
    else:
        peak_table(args)


if __name__ == "__main__":
    main()
