"""A plain Accelerate + DeepSpeed script with `ParallelismConfig(sp_backend="deepspeed", sp_size=2)`.

    torchrun --nproc-per-node 2 tests/sp_switch_script.py {qwen3.5 | qwen3-next | loader-first} OUT.json

Rank 0 writes what happened to OUT.json: the error accelerate or vlmcp_patch raised, or what one
training micro-step saw (CP size, the accelerator's SP size, the batch, the loss, the P=1 loss).
"""

from __future__ import annotations

import json
import sys

import torch
from accelerate import Accelerator, ParallelismConfig, PartialState
from accelerate.utils import DeepSpeedPlugin

import vlmcp_patch
from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_5_config

from vlmcp_patch.fixtures.cpu import configure_cpu_state
from vlmcp_patch.fixtures.data import PaddingCollator, synthetic_dataset


def qwen3_next():
    """A tiny Qwen3-Next: gated DeltaNet layers this package does not handle (accelerate must refuse it)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    return Qwen3NextForCausalLM(Qwen3NextConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        num_experts=2, num_experts_per_tok=1, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"],
    ))


def main(mode: str, out: str) -> None:
    configure_cpu_state("DEEPSPEED")
    model = qwen3_next() if mode == "qwen3-next" else build_model(tiny_qwen3_5_config(), seed=0)
    plugin = DeepSpeedPlugin(hf_ds_config={
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
    })
    accelerator = Accelerator(deepspeed_plugin=plugin,
                              parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2))
    loader = torch.utils.data.DataLoader(synthetic_dataset(8), batch_size=2, collate_fn=PaddingCollator())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    report = {}
    try:
        if mode == "loader-first":
            loader = accelerator.prepare(loader)
        engine, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    except (ValueError, vlmcp_patch.VLMCPError) as error:
        report = {"error": type(error).__name__, "message": str(error)}
    else:
        batch = next(iter(loader))
        with vlmcp_patch.disabled():
            reference = engine(**batch).loss.item()
        loss = engine(**batch).loss
        accelerator.backward(loss)
        report = {
            "cp_size": vlmcp_patch.cp_size(), "accelerator_sp_size": accelerator.parallelism_config.sp_size,
            "train_batch_size": engine.train_batch_size(), "loss": loss.item(), "p1_loss": reference,
            "batches": [t.tolist() for t in accelerator.gather(batch["input_ids"].sum(-1))],
        }
    if PartialState().is_main_process:
        with open(out, "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank at the end before any tears its connections down
        torch.distributed.destroy_process_group()
