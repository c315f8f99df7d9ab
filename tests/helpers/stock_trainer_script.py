"""A stock HF Trainer fine-tuning script: `examples/hf_trainer_sft.py`'s training with `import vlmcp_patch` removed,
and with nothing of the package imported at all (the example's model and data come from `vlmcp_patch.fixtures`,
whose import would apply the patches). The model is a checkpoint folder, the data a file of tokenized samples
(`tests/test_autowrapt.py` writes both); CP can only come from outside, `AUTOWRAPT_BOOTSTRAP=vlmcp_patch`.

    python stock_trainer_script.py MODEL_DIR SAMPLES_PT OUT_DIR [DEEPSPEED_CONFIG]

With a DeepSpeed config it trains under DeepSpeed; on CPU that needs Accelerate's state set to DeepSpeed by hand (two
lines, what any CPU user of the Trainer with DeepSpeed writes; nothing of the package). Writes OUT_DIR/weights.pt (the
trained state dict, gathered under ZeRO-3) and OUT_DIR/run.json (the logged losses, what wrapped the model, and
whether `vlmcp_patch` was in `sys.modules` once training ended) on rank 0.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForImageTextToText, Trainer, TrainingArguments


class PaddingCollator:
    """Right-pad tokenized samples (ids, labels, token types) and concatenate their vision inputs (pixel rows,
    grids)."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, samples: list[dict]) -> dict:
        length = max(len(s["input_ids"]) for s in samples)

        def padded(key, value):
            return torch.stack([torch.nn.functional.pad(s[key], (0, length - len(s[key])), value=value)
                                for s in samples])

        batch = {"input_ids": padded("input_ids", self.pad_token_id), "labels": padded("labels", -100),
                 "mm_token_type_ids": padded("mm_token_type_ids", 0),
                 "attention_mask": torch.stack([torch.arange(length) < len(s["input_ids"]) for s in samples]).long()}
        for key in sorted({k for s in samples for k in s} - set(batch)):
            parts = [s[key] for s in samples if key in s]
            batch[key] = torch.cat(parts) if key.startswith("pixel") else torch.cat([p.reshape(-1, 3) for p in parts])
        return batch


def trained_weights(model) -> dict:
    """The state dict on CPU, gathered where ZeRO-3 partitions the parameters (every rank calls this)."""
    params = list(model.parameters())
    if hasattr(params[0], "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def main() -> None:
    model_dir, samples_file, out, *deepspeed = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    out, deepspeed = Path(out), deepspeed[0] if deepspeed else None
    on_cpu = not torch.cuda.is_available()
    if deepspeed and on_cpu:  # accelerate would otherwise run DeepSpeed on CPU as plain multi-CPU
        from accelerate import PartialState
        from accelerate.utils import DistributedType

        PartialState(cpu=True, backend="gloo").distributed_type = DistributedType.DEEPSPEED
    data = torch.load(samples_file)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, attn_implementation="sdpa")
    args = TrainingArguments(output_dir=str(out / "trainer"), per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_steps=3, learning_rate=0.05, optim="sgd",
                             lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[],
                             remove_unused_columns=False, use_cpu=on_cpu and not deepspeed, deepspeed=deepspeed,
                             accelerator_config={"use_configured_state": True} if deepspeed and on_cpu else None,
                             dataloader_drop_last=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=data["samples"],
                      data_collator=PaddingCollator(data["pad_token_id"]))
    trainer.train()
    weights = trained_weights(trainer.model)
    engine = trainer.model_wrapped
    wrapper = (f"DeepSpeed ZeRO-{engine.zero_optimization_stage()}" if type(engine).__name__ == "DeepSpeedEngine" else
               type(engine).__name__)
    if int(os.environ.get("RANK", "0")) == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(weights, out / "weights.pt")
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        (out / "run.json").write_text(json.dumps({"losses": losses, "vlmcp_patch": "vlmcp_patch" in sys.modules,
                                                  "world": int(os.environ.get("WORLD_SIZE", "1")),
                                                  "wrapper": wrapper}))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
