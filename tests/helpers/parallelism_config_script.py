"""A plain Accelerate script with Accelerate's own switches for sequence / context parallelism.

    torchrun --nproc-per-node 2 tests/helpers/parallelism_config_script.py MODE OUT.json

MODE: `qwen3.5` (DeepSpeed, ParallelismConfig(sp_backend="deepspeed", sp_size=2)), `qwen3-next` (the same
for a model the package does not handle: accelerate's refusal stays), `loader-first` (the data loader
prepared before the model), `fsdp2-cp` (FSDP2, ParallelismConfig(cp_size=2), a tiny Qwen3-VL). Rank 0
writes what happened to OUT.json: the error raised, or what one training micro-step saw (CP size, the
accelerator's parallelism sizes, what wraps the model, the batches of the ranks, the loss, the P=1 loss).
"""

from __future__ import annotations

import json
import sys

import torch
from accelerate import Accelerator, ParallelismConfig, PartialState
from accelerate.utils import DeepSpeedPlugin

import vlmcp_patch
from vlmcp_patch.fixtures.cpu import configure_cpu_fsdp_state, configure_cpu_state
from vlmcp_patch.fixtures.data import PaddingCollator, synthetic_dataset
from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_5_config, tiny_qwen3_vl_config


def qwen3_next():
    """A tiny Qwen3-Next: gated DeltaNet layers this package does not handle (accelerate must refuse it)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    return Qwen3NextForCausalLM(Qwen3NextConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        num_experts=2, num_experts_per_tok=1, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"],
    ))


def accelerator_for(mode: str) -> Accelerator:
    if mode == "fsdp2-cp":
        configure_cpu_state("FSDP")
        config = ParallelismConfig(cp_size=2)
        configure_cpu_fsdp_state({}, config)
        return Accelerator(parallelism_config=config)
    configure_cpu_state("DEEPSPEED")
    plugin = DeepSpeedPlugin(hf_ds_config={
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
    })
    return Accelerator(deepspeed_plugin=plugin, parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2))


def main(mode: str, out: str) -> None:
    accelerator = accelerator_for(mode)
    if mode == "qwen3-next":
        model = qwen3_next()
    else:
        model = build_model(tiny_qwen3_vl_config() if mode == "fsdp2-cp" else tiny_qwen3_5_config(), seed=0)
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
        from torch.distributed.fsdp import FSDPModule

        pc = accelerator.parallelism_config
        report = {
            "cp_size": vlmcp_patch.cp_size(), "accelerator_sp_size": pc.sp_size, "accelerator_cp_size": pc.cp_size,
            "wrapper": "FSDP2" if isinstance(engine, FSDPModule) else type(engine).__name__,
            "loss": loss.item(), "p1_loss": reference,
            "batches": [t.tolist() for t in accelerator.gather(batch["input_ids"].sum(-1))],
        }
        if mode != "fsdp2-cp":
            report["train_batch_size"] = engine.train_batch_size()
    if PartialState().is_main_process:
        with open(out, "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank at the end before any tears its connections down
        torch.distributed.destroy_process_group()
