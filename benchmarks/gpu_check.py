"""The GPU check: the real kernels under the package, in bf16, in a few minutes on one GPU.

    python -m benchmarks.gpu_check                                   # one GPU
    torchrun --nproc-per-node N -m benchmarks.gpu_check              # N GPUs: adds the CP parity at P=N
    python -m benchmarks.gpu_check --dry-run                         # CPU, fp32, torch paths, tiny sizes
    python -m benchmarks.gpu_check --sections 2,3                    # only these sections
    python -m benchmarks.gpu_check --sections 8 --deterministic      # torch's deterministic algorithms

In one process a section that fails prints its traceback and the check goes on to the next (a lent GPU is lent for
minutes); the exit code says whether any failed. Without flash-attn installed the attention runs in sdpa (section 1
says so).

Sections (each prints its numbers; record them in docs/testing.md ("GPU check") with the date and the GPU):
1. the environment: GPU, torch / CUDA, flash-attn, flash-linear-attention, causal-conv1d;
2. packed-row boundaries with the real kernels (flash_attention_2; FLA chunked delta rule and causal-conv1d
   for Qwen3.5 when installed): a packed row of three samples against each sample run alone by stock
   transformers, bf16;
3. the gated DeltaNet head split against the stock layer run on each sample alone (at P = the number of
   GPUs; at P=1 the same code with the kernels' packed-sequence arguments);
4. the per-rank workload: peak memory (beside the plan's price of it) and tokens/s of forward + backward against
   the sequence length;
5. with several GPUs: CP parity of loss and gradients against P=1 on a multimodal packed row;
6. the attained rates in the units `python -m vlmcp_patch plan` takes (matmul and attention TFLOP/s, the
   all-to-all's bus bandwidth in GB/s): printed as the flags to pass it, so one run calibrates the plan;
7. with two GPUs or more: what a stalled CP collective looks like on NCCL — two ranks under torchrun, a CP group
   with a 10 s timeout, one rank never issuing the all-to-all: how long until the job ends, and how (docs/errors.md);
8. checkpoint offload (`VLMCP_OFFLOAD_CHECKPOINTS`): a checkpointed training step with and without it — step time
   (goal: at most 6 % slower), device peak beside the plan's price, the host pool, gradients bit-identical, with two
   controls (each setting run twice): bit-identity needs `--deterministic`, as a GPU's attention backward is not;
9. the tiled MLP (`tiles.py`): one Qwen3-VL-8B-sized decoder MLP over a long slice, forward + backward, in tiles
   against whole — device peak, time, gradients;
10. the recomputed RMSNorms (`tiles.recomputed_norm_forward`): a Qwen3-VL-8B-sized norm over a long slice — the bytes
   it keeps for backward, its step time and gradients, stock against recomputed in row tiles;
11. the fused LM head (`loss.head_loss_sum`): Qwen3-VL-8B's head and its loss over one slice, stock against fused —
   step time, device peak, gradients;
12. by-need choice at a real `mem_get_info` (`by_need.py`): the room a rank reads, 1 GiB held taken off it, and what
   one rank of 8 of this GPU would switch on for Qwen3-VL-8B video rows of 0.5M-4M tokens;
13. the offload's host pool and its out-of-order paths (`offload.py`): the pinned bytes torch's host allocator really
   holds for a step's checkpoints (decoder layers and vision blocks of sizes that are not powers of two) against the
   bytes held, beside one pinned buffer per checkpoint; then a backward that raises midway, `retain_graph` with a
   second backward, and two forwards before one backward, each with offload against without (the same bits), the
   pool whole after each.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import math
import os
import time
import traceback

import torch
import torch.distributed as dist

import vlmcp_patch
from benchmarks.common import MODELS, real_image_processor
from vlmcp_patch.context import CPContext
from vlmcp_patch.distributed import SINGLE_RANK
from vlmcp_patch.fixtures.compare import gradient_errors, rel_err, summed_over_group
from vlmcp_patch.fixtures.data import Segment as S
from vlmcp_patch.fixtures.data import image_processor, make_packed_batch
from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_5_config, tiny_qwen3_vl_config
from vlmcp_patch.layout import segments_from_lengths
from vlmcp_patch.planning import CALIBRATED, Row, Training, activation_memory, dims_from_config, package_ulysses
from vlmcp_patch.report import kernels

PACKED = [[S(text=40), S(image=(64, 96)), S(text=30)], [S(text=25), S(image=(96, 64)), S(text=9)], [S(text=57)]]


class Setup:
    def __init__(self, dry_run: bool):
        self.dry_run = dry_run
        self.device = torch.device("cpu" if dry_run else "cuda", int(os.environ.get("LOCAL_RANK", 0)))
        self.dtype = torch.float32 if dry_run else torch.bfloat16
        self.attn = "sdpa" if dry_run or importlib.util.find_spec("flash_attn") is None else "flash_attention_2"
        self.rank = dist.get_rank() if dist.is_initialized() else 0

    def model(self, family: str):
        if self.dry_run:
            config = tiny_qwen3_vl_config() if family == "qwen3-vl" else tiny_qwen3_5_config()
        else:
            config = MODELS[family](layers=2 if family == "qwen3-vl" else 4, vision_depth=2)  # 4: three DeltaNet
        config._attn_implementation = self.attn
        for sub in (config.get_text_config(), getattr(config, "vision_config", None)):
            if sub is not None:
                sub._attn_implementation = self.attn
        return build_model(config, seed=0, dtype=self.dtype).to(self.device)

    def packed(self, layout=PACKED):
        processor = image_processor() if self.dry_run else real_image_processor()
        row, alone = make_packed_batch(layout, seed=0, processor=processor)
        move = lambda batch: {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}  # noqa: E731
        return move(row), [move(b) for b in alone]

    def say(self, text: str) -> None:
        if self.rank == 0:
            print(text, flush=True)


def environment(setup: Setup) -> None:
    setup.say("== 1. environment")
    gpu = torch.cuda.get_device_name(setup.device) if setup.device.type == "cuda" else "none (dry run on CPU)"
    setup.say(f"  GPU {gpu}; torch {torch.__version__}, CUDA {torch.version.cuda}; "
              f"transformers {importlib.metadata.version('transformers')}; attention {setup.attn}")
    for line in kernels():
        setup.say(line)


def packed_boundaries(setup: Setup) -> None:
    setup.say("== 2. packed row vs its samples alone (stock), logits")
    for family in ("qwen3-vl", "qwen3.5"):
        model = setup.model(family)
        row, alone = setup.packed()
        no_labels = lambda b: {k: v for k, v in b.items() if k != "labels"}  # noqa: E731
        with torch.no_grad():
            vlmcp_patch.enable(cp_size=1)  # a packed row takes the package's path at P=1
            packed = model(**no_labels(row)).logits
            vlmcp_patch.revert()
            try:
                separate = torch.cat([model(**no_labels(b)).logits for b in alone], dim=1)
            finally:
                vlmcp_patch.apply()
        tokens = row["input_ids"].shape[1]
        setup.say(f"  {family:9s} {setup.dtype}: rel. error {rel_err(packed, separate):.2e} over {tokens} tokens")


def deltanet_split(setup: Setup) -> None:
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    world = dist.get_world_size() if dist.is_initialized() else 1
    cp = vlmcp_patch.get_cp_group(world) or SINGLE_RANK
    setup.say(f"== 3. gated DeltaNet head split (P={cp.size}) vs the stock layer on each sample")
    model = setup.model("qwen3.5")
    layer = next(m for m in model.modules() if isinstance(m, Qwen3_5GatedDeltaNet))
    lengths = [37, 129, 64] if setup.dry_run else [1500, 3000, 700]
    g = torch.Generator().manual_seed(0)
    row = torch.randn(1, sum(lengths), layer.hidden_size, generator=g).to(setup.device, setup.dtype)
    ctx = CPContext(cp=cp, segments=segments_from_lengths(lengths))
    start = time.perf_counter()
    with torch.no_grad():
        ours = ctx.gather(layer(ctx.shard(row, dim=1), attention_mask=None, vlmcp_ctx=ctx), dim=1)
        split = time.perf_counter()
        setup.say(f"  the split layer ran in {split - start:.1f} s (the first call compiles any kernel)")
        stock = torch.cat([layer(row[:, a:b]) for a, b in ctx.segments], dim=1)
    setup.say(f"  rel. error {rel_err(ours, stock):.2e} over {sum(lengths)} tokens in {len(lengths)} samples "
              f"(stock per sample: {time.perf_counter() - split:.1f} s)")


def planned_peak_gib(setup: Setup, model, tokens: int, samples: int, **training) -> float:
    """The plan's price (`vlmcp_patch.planning`, its CPU-fitted constants) of this one-process step's device peak:
    the model's weights and their gradients (no optimizer step here) and what `activation_memory` prices for a
    row of `samples` equal samples at P=1, where the package runs no tiles and no recomputed norms."""
    config = model.config
    row = Row(tokens=tokens, vision_tokens=0, sample_tokens=-(-tokens // samples), patches_per_item=0, samples=samples)
    element = next(model.parameters()).element_size()
    plan = Training(sharding="none", bytes_per_value=element, attention=setup.attn, tiled_mlp=False,
                    recompute_norms=False, **training)
    dims = dims_from_config(config, type(model).__name__)
    memory = activation_memory(dims, row, plan, CALIBRATED, 1, package_ulysses(dims, 1))
    return (2 * element * sum(p.numel() for p in model.parameters()) + memory.total) / 2**30


def _against_plan(measured: float, planned: float) -> str:
    return f"plan {planned:.3f} GiB" + ("" if math.isnan(measured) else f" ({planned / measured - 1:+.1%})")


def workload(setup: Setup, budget_s: float) -> None:
    setup.say("== 4. per-rank workload: forward + backward of one packed row")
    model = setup.model("qwen3-vl")
    lengths = [512, 1024] if setup.dry_run else [4096, 8192, 16384, 32768, 65536]
    vlmcp_patch.enable(cp_size=dist.get_world_size() if dist.is_initialized() else 1)
    start = time.perf_counter()
    for n in lengths:
        half = n // 2
        row, _ = make_packed_batch([[S(text=half)], [S(text=n - half)]], seed=0)
        row = {k: v.to(setup.device) if torch.is_tensor(v) else v for k, v in row.items()}
        _reset_peak(setup)
        t0 = time.perf_counter()
        try:
            model(**row).loss.backward()
        except torch.OutOfMemoryError:
            setup.say(f"  {n:>6d} tokens: out of memory")
            break
        if setup.device.type == "cuda":
            torch.cuda.synchronize(setup.device)
        seconds = time.perf_counter() - t0
        peak = _step_peak_gib(setup)
        planned = planned_peak_gib(setup, model, n, 2, gradient_checkpointing=False)
        setup.say(f"  {n:>6d} tokens: peak {peak:6.2f} GiB ({_against_plan(peak, planned)}), "
                  f"{n / seconds:9.0f} tokens/s")
        model.zero_grad(set_to_none=True)
        if time.perf_counter() - start > budget_s:
            break
    vlmcp_patch.enable(cp_size=1)


def cp_parity(setup: Setup) -> None:
    size = dist.get_world_size()
    setup.say(f"== 5. CP parity at P={size} against P=1 (loss and summed gradients)")
    for family in ("qwen3-vl", "qwen3.5"):
        model = setup.model(family)
        row, _ = setup.packed()
        results = []
        for cp_size in (1, size):
            vlmcp_patch.enable(cp_size=cp_size)
            model.zero_grad(set_to_none=True)
            loss = model(**row).loss
            loss.backward()
            grads = {n: p.grad.detach() for n, p in model.named_parameters() if p.grad is not None}
            cp = vlmcp_patch.get_cp_group(cp_size)
            results.append((loss.detach(), summed_over_group(grads, None if cp is None else cp.group)))
        vlmcp_patch.enable(cp_size=1)
        (l1, g1), (lp, gp) = results
        errors, _ = gradient_errors(gp, g1)
        name, worst = max(errors.items(), key=lambda item: item[1])
        loss_error = rel_err(lp, l1)
        setup.say(f"  {family:9s} loss rel. error {loss_error:.2e}, worst gradient rel. error {worst:.2e} ({name})")


def _seconds(setup: Setup, fn, repeats: int) -> float:
    """Seconds per call of `fn` after one warm-up (synchronised on a GPU)."""
    fn()
    if setup.device.type == "cuda":
        torch.cuda.synchronize(setup.device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if setup.device.type == "cuda":
        torch.cuda.synchronize(setup.device)
    return (time.perf_counter() - start) / repeats


def matmul_tflops(setup: Setup) -> float:
    """Attained TFLOP/s of a projection-sized matmul (tokens x hidden @ hidden x 4 hidden), the model's dtype."""
    n, h = (256, 128) if setup.dry_run else (8192, 4096)
    x = torch.randn(n, h, device=setup.device, dtype=setup.dtype)
    w = torch.randn(4 * h, h, device=setup.device, dtype=setup.dtype)
    return 2 * n * h * 4 * h / _seconds(setup, lambda: x @ w.T, 3 if setup.dry_run else 20) / 1e12


def attention_tflops(setup: Setup) -> float:
    """Attained TFLOP/s of causal attention forward + backward, counted as the plan counts it (forward
    2 s^2 H D, backward 2.5 x): flash-attn's kernel when installed, else sdpa."""
    s, h, d = (256, 4, 32) if setup.dry_run else (16384, 32, 128)
    q, k, v = (torch.randn(1, s, h, d, device=setup.device, dtype=setup.dtype, requires_grad=True) for _ in range(3))
    try:
        from flash_attn import flash_attn_func

        attend = lambda: flash_attn_func(q, k, v, causal=True)  # noqa: E731
    except ImportError:
        import torch.nn.functional as F

        attend = lambda: F.scaled_dot_product_attention(  # noqa: E731
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)

    def step():
        attend().sum().backward()

    return 3.5 * 2 * s * s * h * d / _seconds(setup, step, 2 if setup.dry_run else 10) / 1e12


def all_to_all_gbs(setup: Setup) -> float | None:
    """Bus bandwidth of an all-to-all among all ranks (GB/s per rank: bytes leaving a rank / time), or None alone."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return None
    world = dist.get_world_size()
    data = torch.randn((1 << 16) if setup.dry_run else (1 << 27), device=setup.device, dtype=setup.dtype)
    out = torch.empty_like(data)
    seconds = _seconds(setup, lambda: dist.all_to_all_single(out, data), 3 if setup.dry_run else 10)
    return data.numel() * data.element_size() * (world - 1) / world / seconds / 1e9


def plan_rates(setup: Setup) -> None:
    setup.say("== 6. attained rates for `python -m vlmcp_patch plan`")
    matmul, attention = matmul_tflops(setup), attention_tflops(setup)
    link = all_to_all_gbs(setup)
    setup.say(f"  matmul {matmul:.4g} TFLOP/s, attention {attention:.4g} TFLOP/s"
              + (f", all-to-all {link:.4g} GB/s per rank" if link is not None else ", one rank: no link measured"))
    flags = f"--matmul-tflops {matmul:.4g} --attention-tflops {attention:.4g}"
    if link is not None:  # within one node: NVLink; a launch across nodes measures the slower link
        flags += f" --nvlink-gbs {link:.4g}"
    setup.say(f"  plan flags: {flags}")


STALL_TIMEOUT_S = 10


def nccl_stall_worker() -> None:
    """One rank of section 7 (`--nccl-stall-worker`, under torchrun with 2 processes): rank 1 never issues the CP
    all-to-all that rank 0 waits in."""
    from vlmcp_patch.collectives.differentiable import all_to_all

    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    vlmcp_patch.enable(cp_size=2, timeout=STALL_TIMEOUT_S)
    cp = vlmcp_patch.get_cp_group(2)
    if cp.rank == 1:
        time.sleep(6 * STALL_TIMEOUT_S)
        os._exit(0)
    print(f"rank 0: issuing the all-to-all at {time.time():.1f}", flush=True)
    all_to_all(torch.ones(1, 4, 2, device="cuda"), 1, 2, cp.group, 2)
    torch.cuda.synchronize()  # NCCL returns at once: the wait is here
    print("rank 0: the all-to-all completed (it should not have)", flush=True)


def nccl_stall(setup: Setup) -> None:
    setup.say(f"== 7. a stalled CP collective on NCCL (two ranks, CP groups' timeout {STALL_TIMEOUT_S} s)")
    if torch.cuda.device_count() < 2:
        setup.say("  skipped: needs two GPUs")
        return
    import subprocess
    import sys

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "benchmarks.gpu_check",
               "--nccl-stall-worker"]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=8 * STALL_TIMEOUT_S)
        ended = f"exit code {done.returncode}"
        output = done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:
        ended, output = "still running: killed (a hang)", f"{expired.stdout or ''}{expired.stderr or ''}"
    seconds = time.perf_counter() - start
    setup.say(f"  the job ended after {seconds:.0f} s ({ended}); what it printed about the stall:")
    for line in output.splitlines():
        if any(word in line for word in ("Watchdog", "timed out", "Timeout", "CollectiveError", "rank 0:")):
            setup.say(f"    {line[:200]}")


def _step_peak_gib(setup: Setup) -> float:
    return torch.cuda.max_memory_allocated(setup.device) / 2**30 if setup.device.type == "cuda" else float("nan")


def _reset_peak(setup: Setup) -> None:
    if setup.device.type == "cuda":
        torch.cuda.synchronize(setup.device)
        torch.cuda.reset_peak_memory_stats(setup.device)


def _timed_with_peak(setup: Setup, step) -> tuple[float, float]:
    """One call of `step` first (first allocations, kernel selection, a host pool's buffers), then its seconds per
    call (`_seconds`) and the device peak in GiB of the calls timed."""
    step()
    _reset_peak(setup)
    seconds = _seconds(setup, step, 1 if setup.dry_run else 5)
    return seconds, _step_peak_gib(setup)


def checkpoint_offload(setup: Setup) -> None:
    """Section 8: one checkpointed step of a packed text row (two samples: the package's path and its chunked loss,
    so the head's logits do not set the peak), the package's checkpoint offload off, off again (the control: is the
    step itself deterministic on this GPU?), on, and on again (a race in the copies would differ between those two);
    one process, P=1: the offload applies with CP or not."""
    from vlmcp_patch.offload import HOST_CHECKPOINTS

    tokens = 1024 if setup.dry_run else 32768
    setup.say(f"== 8. checkpoint offload: a checkpointed step of {tokens} tokens, VLMCP_OFFLOAD_CHECKPOINTS off / on")
    model = setup.model("qwen3-vl") if setup.dry_run else build_model(
        MODELS["qwen3-vl"](layers=12, vision_depth=2), seed=0, dtype=setup.dtype).to(setup.device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    row, _ = make_packed_batch([[S(text=tokens // 2)], [S(text=tokens - tokens // 2)]], seed=0)
    row = {k: v.to(setup.device) if torch.is_tensor(v) else v for k, v in row.items()}
    results = []
    for offload in (False, False, True, True):
        vlmcp_patch.enable(cp_size=1, offload_checkpoints=offload)

        def step():
            model.zero_grad(set_to_none=True)
            model(**row).loss.backward()

        seconds, peak = _timed_with_peak(setup, step)
        # kept on the host: a copy on the device would count in the next run's peak
        grads = {n: p.grad.detach().to("cpu", copy=True) for n, p in model.named_parameters() if p.grad is not None}
        results.append((seconds, peak, grads))
    planned = [planned_peak_gib(setup, model, tokens, 2, gradient_checkpointing=True, offload_checkpoints=offload)
               for offload in (False, True)]
    vlmcp_patch.enable(offload_checkpoints=False)
    (t_off, peak_off, g_off), (_, _, g_again), (t_on, peak_on, g_on), (_, _, g_on_again) = results

    def compared(grads: dict, reference: dict) -> str:
        identical = grads.keys() == reference.keys() and all(torch.equal(grads[n], reference[n]) for n in reference)
        worst = max(rel_err(grads[n], reference[n]) for n in reference)
        return f"bit-identical {identical} (worst rel. error {worst:.2e})"

    setup.say(f"  step {t_off:.4f} s without, {t_on:.4f} s with offload: x{t_on / t_off:.3f} (goal <= 1.06); "
              f"device peak {peak_off:.2f} -> {peak_on:.2f} GiB ({_against_plan(peak_off, planned[0])} -> "
              f"{_against_plan(peak_on, planned[1])}); host pool {HOST_CHECKPOINTS.pool.reserved / 2**30:.3f} GiB")
    setup.say(f"  gradients with offload against without: {compared(g_on, g_off)}; controls: without against "
              f"without {compared(g_again, g_off)}, with against with {compared(g_on_again, g_on)}")
    model.gradient_checkpointing_disable()


def tiled_mlp(setup: Setup) -> None:
    """Section 9: one decoder MLP of Qwen3-VL-8B's size (hidden 4096, intermediate 12288) over a long slice, forward
    and backward whole and in the package's automatic tiles (`tiles.run_in_tiles`)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextMLP

    from vlmcp_patch.tiles import TILES, run_in_tiles

    tokens, hidden, inter = (4096, 64, 256) if setup.dry_run else (65536, 4096, 12288)
    setup.say(f"== 9. tiled MLP: {tokens} tokens through a {hidden} x {inter} gated MLP, whole and in tiles")
    config = tiny_qwen3_vl_config().get_text_config()
    config.hidden_size, config.intermediate_size = hidden, inter
    torch.manual_seed(0)
    mlp = Qwen3VLTextMLP(config).to(setup.device, setup.dtype)
    x = torch.randn(tokens, hidden, device=setup.device, dtype=setup.dtype)
    grad_out = torch.randn_like(x)
    TILES.drain()  # count this section's tiles only
    results = {}
    for tiled in (False, True):
        def step():
            mlp.zero_grad(set_to_none=True)
            xs = x.detach().requires_grad_()
            out = run_in_tiles(mlp, [xs], mlp, hidden, 4 * inter) if tiled else mlp(xs)
            out.backward(grad_out)
            return xs.grad

        seconds, peak = _timed_with_peak(setup, step)  # before the copies kept for the comparison, on the host
        input_grad = step().cpu()
        weight_grads = {n: p.grad.to("cpu", copy=True) for n, p in mlp.named_parameters()}
        results[tiled] = (seconds, peak, input_grad, weight_grads)
    counts = TILES.drain()
    (t_whole, peak_whole, gx_whole, gp_whole), (t_tiled, peak_tiled, gx_tiled, gp_tiled) = results[False], results[True]
    worst = max(rel_err(gp_tiled[n], gp_whole[n]) for n in gp_whole)
    setup.say(f"  {counts['forward_tiles'] // max(1, counts['calls'])} tiles; step {t_whole:.4f} s whole, "
              f"{t_tiled:.4f} s tiled: x{t_tiled / t_whole:.3f}; device peak {peak_whole:.2f} -> {peak_tiled:.2f} GiB; "
              f"input gradient rel. error {rel_err(gx_tiled, gx_whole):.2e}, worst weight gradient {worst:.2e}")
    # the plan's `mlp_work` (fitted on this repository's CPU, fp32) in the GPU's units: what the whole MLP's step holds
    # above the weights, the input and output gradient and the gradients it makes, per 4 x intermediate per token
    element = x.element_size()
    fixed = sum(p.numel() for p in mlp.parameters()) * 2 * element + 3 * x.numel() * element
    work = (peak_whole * 2**30 - fixed) / (tokens * 4 * inter * element)
    setup.say(f"  the whole MLP's working set: {work:.3f} x (4 x intermediate) per token "
              f"(the plan's mlp_work, fitted on CPU fp32: {CALIBRATED.mlp_work})")


def recomputed_norm(setup: Setup) -> None:
    """Section 10: one RMSNorm of Qwen3-VL-8B's width over a long slice, stock and recomputed in row tiles as the
    package runs it under CP (`tokenwise_tiles`, the tiles of `recomputed_norm_forward`): what autograd keeps for
    backward, the step time, the gradients."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRMSNorm

    from vlmcp_patch.tiles import NORM_BACKWARD_WIDTH, NORMS, tile_bounds, tile_tokens, tokenwise_tiles

    tokens, hidden = (4096, 64) if setup.dry_run else (131072, 4096)
    setup.say(f"== 10. recomputed RMSNorm: {tokens} tokens of width {hidden}, stock and recomputed in row tiles")
    norm = Qwen3VLTextRMSNorm(hidden).to(setup.device, setup.dtype)
    x = torch.randn(tokens, hidden, device=setup.device, dtype=setup.dtype)
    grad_out = torch.randn_like(x)
    bounds = tile_bounds(tokens, tile_tokens(tokens, hidden, NORM_BACKWARD_WIDTH * hidden))
    results = {}
    for recomputed in (False, True):
        kept: dict = {}  # storage -> bytes of what autograd keeps for backward

        def keep(t: torch.Tensor) -> torch.Tensor:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        def step():
            norm.zero_grad(set_to_none=True)
            xs = x.detach().requires_grad_()
            kept.clear()
            with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                out = tokenwise_tiles(norm, bounds, NORMS, [xs], [norm.weight]) if recomputed else norm(xs)
            out.backward(grad_out)
            return xs.grad

        seconds = _seconds(setup, step, 1 if setup.dry_run else 5)
        results[recomputed] = (seconds, sum(kept.values()) / 2**30, step(), norm.weight.grad.clone())
    (t_stock, kept_stock, gx_stock, gw_stock), (t_ours, kept_ours, gx_ours, gw_ours) = results[False], results[True]
    setup.say(f"  {len(bounds)} tiles; kept for backward {kept_stock:.3f} -> {kept_ours:.3f} GiB; step {t_stock:.4f} s "
              f"stock, {t_ours:.4f} s recomputed: x{t_ours / t_stock:.3f}; input gradient rel. error "
              f"{rel_err(gx_ours, gx_stock):.2e}, weight gradient {rel_err(gw_ours, gw_stock):.2e}")


def fused_head(setup: Setup) -> None:
    """Section 11: the package's fused LM head and loss (`loss.head_loss_sum`, in chunks, the weight's gradient
    accumulated in fp32) against stock's (the logits, their fp32 upcast, cross-entropy), Qwen3-VL-8B's head (4096 x
    151,936) over one slice of tokens, forward + backward: step time, device peak, gradients."""
    import torch.nn.functional as F

    from vlmcp_patch.loss import IGNORE_INDEX, chunk_tokens, head_loss_sum

    tokens, hidden, vocab = (512, 64, 1000) if setup.dry_run else (32768, 4096, 151936)
    setup.say(f"== 11. fused LM head: {tokens} tokens through a {hidden} x {vocab} head and its loss, stock and fused")
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False).to(setup.device, setup.dtype)
    h = torch.randn(tokens, hidden, device=setup.device, dtype=setup.dtype)
    labels = torch.randint(vocab, (tokens,), device=setup.device)
    labels[::7] = IGNORE_INDEX
    chunk = chunk_tokens(tokens, hidden, vocab)
    results = {}
    for fused in (False, True):
        def step():
            head.zero_grad(set_to_none=True)
            hs = h.detach().requires_grad_()
            loss = head_loss_sum(hs, head, labels, chunk) if fused else F.cross_entropy(
                head(hs).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
            loss.backward()
            return hs.grad

        seconds, peak = _timed_with_peak(setup, step)
        input_grad = step().cpu()
        results[fused] = (seconds, peak, input_grad, head.weight.grad.float().cpu())
    (t_stock, peak_stock, gx_stock, gw_stock), (t_ours, peak_ours, gx_ours, gw_ours) = results[False], results[True]
    setup.say(f"  chunks of {chunk} tokens; step {t_stock:.4f} s stock, {t_ours:.4f} s fused: x{t_ours / t_stock:.3f}; "
              f"device peak {peak_stock:.2f} -> {peak_ours:.2f} GiB; input gradient rel. error "
              f"{rel_err(gx_ours, gx_stock):.2e}, weight gradient {rel_err(gw_ours, gw_stock):.2e}")


def by_need_choice(setup: Setup) -> None:
    """Section 12: the choice by need (`vlmcp_patch/by_need.py`) at a real `torch.cuda.mem_get_info`: the room a rank
    reads with a model loaded, that 1 GiB held takes 1 GiB off it and comes back once freed (the allocator's unused
    cache counted as room), and what this GPU, as one rank of a node of 8, would choose for Qwen3-VL-8B video rows
    (ZeRO-3, checkpointing, checkpoints offloaded): each row's switches and predicted peak beside the room left after
    the weights, gradients and optimizer's share and the host's room for the pool and parked features
    (`by_need.local_host_room`: the node's available memory shared by 8 ranks), or the refusal. The dry run stands a
    141 GiB budget for the device."""
    from vlmcp_patch import by_need
    from vlmcp_patch.errors import UnsupportedSetupError
    from vlmcp_patch.planning import model_dims, static_memory

    gib = 2**30
    if setup.dry_run:
        vlmcp_patch.enable(device_memory_gib=141)
    try:
        model = setup.model("qwen3-vl")
        model.train()
        room = by_need.local_room(model, setup.device)
        held = torch.empty(gib, dtype=torch.uint8, device=setup.device)
        holding = by_need.local_room(model, setup.device)
        del held
        freed = by_need.local_room(model, setup.device)
        drop = (room - holding) / gib
        setup.say(f"  room with the test model loaded {room / gib:.2f} GiB; holding 1 GiB {holding / gib:.2f} "
                  f"(drop {drop:.3f} GiB{'' if setup.dry_run else ', goal 1.000'}); freed again {freed / gib:.2f}")
        dims = model_dims("qwen3-vl-8b")
        base = Training(sharding="zero3", gradient_checkpointing=True, offload_checkpoints=True, tiled_mlp=False,
                        tiled_vision=False, recompute_norms=False)
        del model
        device_room = by_need.local_room(torch.nn.Linear(1, 1, device=setup.device), setup.device)
        left = device_room - sum(static_memory(dims, base, 8))
        host_room = by_need.local_host_room(setup.device)
        host_text = "no limit" if host_room is None else f"{host_room / gib:.1f} GiB"
        setup.say(f"  one rank of 8, Qwen3-VL-8B: {device_room / gib:.2f} GiB room, {left / gib:.2f} GiB after the "
                  f"weights, gradients and optimizer's share; host room for its pool and parked features {host_text}")
        for tokens in (2**19, 2**20, 2**21, 2**22):
            row = Row.video(tokens)
            try:
                switches, peak, why = by_need.choose(dims, row, base, 8, package_ulysses(dims, 8, 8), left,
                                                     host_room)
                on = ", ".join(by_need.LABELS[n] for n in switches.on()) or "none"
                setup.say(f"  {tokens:>9,} tokens: switches {on}; predicted {peak / gib:.2f} GiB ({why})")
            except UnsupportedSetupError as refusal:
                setup.say(f"  {tokens:>9,} tokens: refused: {str(refusal)[:240]}...")
    finally:
        vlmcp_patch.enable(device_memory_gib=0)


def _pinned_bytes(setup: Setup) -> int | None:
    """The bytes torch's caching host allocator holds (pinned blocks, as rounded), or None without CUDA."""
    if setup.device.type != "cuda":
        return None
    torch.cuda.synchronize(setup.device)
    torch.accelerator.empty_host_cache()  # cached free blocks would serve the next requests without counting
    return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))


def host_pool_and_paths(setup: Setup) -> None:
    """Section 13: (a) a step's checkpoints taken from a fresh pool (36 decoder layers and 24 vision blocks whose sizes
    are not powers of two), pinned on a GPU: the allocator's bytes against the bytes held, and against one pinned
    buffer per checkpoint (the control: what the allocator's power-of-two rounding costs); (b) the three paths that
    free checkpoints out of order, on this device, each against the same path without offload."""
    from tests.helpers.offload_cases import (
        backward_that_raises,
        backward_twice,
        grads_of,
        pool_state,
        two_forwards_one_backward,
    )
    from vlmcp_patch.offload import HOST_CHECKPOINTS, HostPool, pool_bytes_for

    setup.say("== 13. offload: the host pool's real bytes, and the paths that free checkpoints out of order")
    scale = 64 if setup.dry_run else 1
    sizes = [24 * 37 * 2**20 // 24 // scale + 4096] * 24 + [151 * 2**20 // scale + 4096] * 35
    pinned = setup.device.type == "cuda"
    before = _pinned_bytes(setup)
    pool, start = HostPool(), time.perf_counter()
    for _ in range(2):  # two steps: the second allocates nothing
        leases = [pool.take(n, pinned) for n in sizes]
        for lease in reversed(leases):
            pool.give_back(lease)
    seconds = time.perf_counter() - start
    pool.check()
    held = pool.peak_held
    real = pool.reserved if before is None else _pinned_bytes(setup) - before
    setup.say(f"  {len(sizes)} checkpoints, {held / 2**30:.3f} GiB held: the pool {pool.reserved / 2**30:.3f} GiB in "
              f"{len(pool.slabs)} slabs, {'pinned by torch' if pinned else 'dry run, unpinned: the pool count'} "
              f"{real / 2**30:.3f} GiB: ratio {real / held:.4f} (goal <= 1.05; priced {pool_bytes_for(held) / held:.4f}"
              f"); {seconds:.2f} s to allocate")
    del leases, pool
    if pinned:
        before = _pinned_bytes(setup)
        buffers = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in sizes[-8:]]
        per_buffer = _pinned_bytes(setup) - before
        setup.say(f"  control, one pinned buffer per checkpoint: {per_buffer / sum(sizes[-8:]):.4f} x the bytes held")
        del buffers
        torch.accelerator.empty_host_cache()

    tokens = 256 if setup.dry_run else 8192
    model = setup.model("qwen3-vl") if setup.dry_run else build_model(
        MODELS["qwen3-vl"](layers=6, vision_depth=2), seed=0, dtype=setup.dtype).to(setup.device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    # plain text rows, stock transformers' path (stock Qwen3-VL keeps its vision graph alive after a backward that
    # raised; the package's packed-row path is not what these paths test)
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": ids, "labels": ids.clone()} for ids in
            (torch.randint(0, model.config.text_config.vocab_size, (1, tokens), generator=g).to(setup.device)
             for _ in range(2))]

    def same(a, b) -> bool:
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    def one_step():
        model.zero_grad(set_to_none=True)
        loss = model(**rows[0]).loss
        loss.backward()
        return {"loss": loss.detach(), **grads_of(model)}

    def on_host(values: dict) -> dict:  # kept on the host: three runs' gradients of an 8B-wide model
        return {k: v.detach().to("cpu", copy=True) for k, v in values.items()}

    def paths(offload: bool) -> dict:
        vlmcp_patch.enable(cp_size=1, offload_checkpoints=offload)
        out = {"raised": backward_that_raises(model, rows[0]), "raised pool": pool_state(), "next": on_host(one_step())}
        first, second, _ = backward_twice(model, rows[0])
        out.update({"retain first": on_host(first), "retain second": on_host(second), "retain pool": pool_state()})
        total, grads = two_forwards_one_backward(model, rows)
        out.update({"two": on_host({"loss": total, **grads}), "two pool": pool_state()})
        return out

    keys = (("a backward that raises midway, then a step", "next"), ("retain_graph: first backward", "retain first"),
            ("retain_graph: second backward", "retain second"), ("two forwards, one backward", "two"))
    try:
        without = paths(False)
        again = paths(False)
        control = {key: same(again[key], without[key]) for _, key in keys}
        del again
        with_ = paths(True)
    finally:
        vlmcp_patch.enable(offload_checkpoints=False)
        model.gradient_checkpointing_disable()
    for name, key in keys:
        setup.say(f"  {name}: with offload against without: same bits {same(with_[key], without[key])} "
                  f"(control, without against without: same bits {control[key]})")
    left = {k: with_[k]["in_use"] for k in ("raised pool", "retain pool", "two pool")}
    setup.say(f"  raised: {with_['raised']!r}; pool bytes still given out after each path: {left}; host pool "
              f"{HOST_CHECKPOINTS.pool.reserved / 2**20:.1f} MiB")


def run_section(setup: Setup, number: int, section, *args) -> bool:
    """Run one section; in one process a failure prints its traceback and returns False, so the sections after it
    still run. Under torchrun it raises: a rank that went on would issue the next section's collectives while its
    peers wait in this one's."""
    try:
        section(setup, *args)
        return True
    except Exception:  # noqa: BLE001 - reported, and counted in the exit code
        if dist.is_initialized() and dist.get_world_size() > 1:
            raise
        setup.say(f"  section {number} FAILED:\n" + traceback.format_exc(limit=8))
        vlmcp_patch.apply()  # a section may have failed with the patches reverted or CP on
        vlmcp_patch.enable(cp_size=1, offload_checkpoints=False)
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, fp32, torch paths, tiny sizes")
    parser.add_argument("--workload-budget", type=float, default=120, help="seconds for section 4")
    parser.add_argument("--deterministic", action="store_true",
                        help="torch's deterministic algorithms (an op without one raises), cuBLAS's fixed workspace")
    parser.add_argument("--sections", default="", help="comma-separated section numbers to run (default: all)")
    parser.add_argument("--nccl-stall-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.nccl_stall_worker:
        return nccl_stall_worker()
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("gloo" if args.dry_run else "nccl")
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    setup = Setup(args.dry_run)
    if setup.device.type == "cuda":
        torch.cuda.set_device(setup.device)
    several = dist.is_initialized() and dist.get_world_size() > 1
    sections = [
        (1, environment, ()),
        (2, packed_boundaries, ()),
        (3, deltanet_split, ()),
        (4, workload, (args.workload_budget,)),
        (5, cp_parity, ()) if several else None,
        (6, plan_rates, ()),
        (7, nccl_stall, ()) if not args.dry_run and setup.rank == 0 else None,
        # one process: these sections measure one rank's step
        *([(8, checkpoint_offload, ()), (9, tiled_mlp, ()), (10, recomputed_norm, ()), (11, fused_head, ()),
           (12, by_need_choice, ()), (13, host_pool_and_paths, ())]
          if setup.rank == 0 and not several else []),
    ]
    wanted = {int(n) for n in args.sections.split(",") if n.strip()}
    failed = [number for number, section, extra in filter(None, sections)
              if (not wanted or number in wanted) and not run_section(setup, number, section, *extra)]
    setup.say("gpu_check: done" + (f"; sections that failed: {failed}" if failed else ""))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
