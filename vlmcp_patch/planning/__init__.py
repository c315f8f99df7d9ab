"""Plan before you book: a cost model of one CP training step — per-rank peak memory and step time — for each CP
size P and each U x R layout a model's heads allow. Pure arithmetic: this module imports nothing heavy itself (the
package's own rules it prices — `layout.ulysses_choices` and `ulysses_degree`, `layout.kv_replication_factor`,
`loss.chunk_tokens` — are imported when a plan is made).

    python -m vlmcp_patch plan --model qwen3-vl-8b --video-tokens 1048576 --gpus-per-node 8 --gpu h100
    vlmcp_patch.plan(model="qwen3.5-27b", row=Row.video(524288), gpu="h100")   # -> list[PlanRow]
    planning.price("qwen3-vl-8b", Row.video(2**21), 8, training=Training(offload_checkpoints=True))  # one PlanRow:
    # its device peak and budget, its host per node and budget, which binds

Units: bytes, seconds, FLOP/s; link bandwidths in GB/s (1e9 bytes/s) per GPU and direction, as NCCL's "bus
bandwidth" reports it; attained rates in TFLOP/s (1e12 FLOP/s). How each number is made and how it was checked
against measurements: docs/plan.md.

The package, by concern: `dims` (model dimensions), `rows` (the row), `hardware` (GPUs and their links),
`training` (the step's setup and the fitted constants), `layouts` (the package's U x R rules), `memory`, `host` (the
node's host memory: pools, offloaded optimizer, the data loader's batches, pinned or not, and collations, the
allowance), `timing`,
`table` (the plan's rows and their marks), `longest` (the longest row on one node), `printing` (the table and docs/plan.md's sizing table), `command`.
"""

from __future__ import annotations

from .command import main
from .dims import MODELS, ModelDims, dims_from_config, model_dims
from .hardware import DEVICE_MARGIN, DGX_HOST_GIB, GIB, GPUS, Hardware, hardware
from .host import (
    HOST_GIB_PER_RANK,
    HOST_NODE_SHARE,
    SHARE_DECODE_GROUPS_PER_CALL,
    HostOptimizer,
    LoaderHost,
    allowance_bytes,
    batch_host_bytes,
    checkpoint_pool_bytes,
    loader_host,
    offloaded_optimizer_host,
    pinned_block_bytes,
)
from .layouts import candidate_sizes, layouts, package_ulysses, replicated
from .longest import ALST_LONGEST, Longest, host_breakdown, longest_lines, longest_row
from .memory import (
    Memory,
    activation_memory,
    attention_elements,
    deltanet_elements,
    deltanet_rule_elements,
    exchange_elements,
    flash_backward_scratch_bytes,
    norm_tile_scratch_bytes,
    rotary_bytes,
    static_memory,
    vision_elements,
)
from .printing import SIZING_MODELS, SIZING_TOKENS, assumptions, format_table, longest_table, sizing_table
from .rows import Row
from .table import PlanRow, mark, plan, price
from .timing import (
    TILE_PASSES_BACKWARD,
    TILE_PASSES_FORWARD,
    Time,
    all_to_all_seconds,
    link_gbs,
    ring_tile_seconds,
    step_flops,
    step_time,
)
from .training import CALIBRATED, Constants, Training

__all__ = [
    "ALST_LONGEST", "DEVICE_MARGIN", "DGX_HOST_GIB", "HOST_GIB_PER_RANK", "HOST_NODE_SHARE", "HostOptimizer",
    "SHARE_DECODE_GROUPS_PER_CALL", "LoaderHost", "host_breakdown", "loader_host",
    "allowance_bytes", "batch_host_bytes", "checkpoint_pool_bytes", "flash_backward_scratch_bytes",
    "norm_tile_scratch_bytes", "offloaded_optimizer_host", "pinned_block_bytes", "price", "rotary_bytes",
    "CALIBRATED", "GIB", "GPUS", "MODELS", "SIZING_MODELS", "SIZING_TOKENS", "TILE_PASSES_BACKWARD",
    "TILE_PASSES_FORWARD", "Constants", "Hardware", "Memory", "ModelDims", "PlanRow", "Row", "Time", "Training",
    "activation_memory", "all_to_all_seconds", "assumptions", "attention_elements", "candidate_sizes",
    "deltanet_elements", "deltanet_rule_elements", "dims_from_config", "exchange_elements", "format_table",
    "hardware", "layouts", "Longest", "longest_lines", "longest_row", "link_gbs", "longest_table", "main", "mark", "model_dims", "package_ulysses", "plan", "replicated",
    "ring_tile_seconds", "sizing_table", "static_memory", "step_flops", "step_time", "vision_elements",
]
