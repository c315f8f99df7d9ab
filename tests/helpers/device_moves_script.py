"""Which of a batch's tensors each rank asks to move to its device, through each training stack: one step of the HF
Trainer (DDP), TRL's SFTTrainer, a raw Accelerate loop (a prepared data loader) and a raw loop with
`vlmcp_patch.batch_to_device`.

    [VLMCP_CP_SIZE=2 torchrun --nproc-per-node 2] tests/helpers/device_moves_script.py OUT.json STACK...

Every pixel tensor a collator produces is recorded (its storage address and rows), and so is every `Tensor.to` call
that names a device (`fixtures.probes.DeviceMoves`). Rank 0 writes both, per stack, to OUT.json.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

import vlmcp_patch
from vlmcp_patch.fixtures.probes import DeviceMoves

PIXEL_KEYS = ("pixel_values", "pixel_values_videos")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))  # example_common, trl_sft


class Recording:
    """Wraps a collator: the storage address and rows of every pixel tensor it produces."""

    def __init__(self, collate, produced: list):
        self.collate, self.produced = collate, produced

    def __call__(self, rows):
        batch = self.collate(rows)
        for key in PIXEL_KEYS:
            if torch.is_tensor(batch.get(key)):
                self.produced.append((batch[key].untyped_storage().data_ptr(), batch[key].shape[0]))
        return batch


def _arguments(output_dir: str) -> dict:
    return dict(output_dir=output_dir, per_device_train_batch_size=2, gradient_accumulation_steps=1, max_steps=1,
                learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True, seed=0, remove_unused_columns=False,
                dataloader_drop_last=True)


def trainer_step(produced: list, output_dir: str) -> None:
    from example_common import data_collator, load_model, samples
    from transformers import Trainer, TrainingArguments

    model = load_model("tiny-qwen3-vl", "sdpa")
    args = TrainingArguments(**_arguments(output_dir))
    Trainer(model=model, args=args, train_dataset=samples("tiny-qwen3-vl", 8),
            data_collator=Recording(data_collator("tiny-qwen3-vl", "padded", model), produced)).train()


def trl_sft_step(produced: list, output_dir: str) -> None:
    from example_common import load_model
    from trl import SFTConfig, SFTTrainer
    from trl_sft import image_text_dataset

    from vlmcp_patch.fixtures.processor import tiny_processor

    config = SFTConfig(**{k: v for k, v in _arguments(output_dir).items() if k != "remove_unused_columns"}, bf16=False)
    trainer = SFTTrainer(model=load_model("tiny-qwen3-vl", "sdpa"), args=config, train_dataset=image_text_dataset(8),
                         processing_class=tiny_processor())
    trainer.data_collator = Recording(trainer.data_collator, produced)
    trainer.train()


def _loader(produced: list):
    from vlmcp_patch.fixtures.data import PaddingCollator, synthetic_dataset

    return torch.utils.data.DataLoader(synthetic_dataset(4), batch_size=2,
                                       collate_fn=Recording(PaddingCollator(), produced))


def accelerate_step(produced: list, output_dir: str) -> None:
    from accelerate import Accelerator
    from example_common import load_model

    accelerator = Accelerator(cpu=True)
    model = load_model("tiny-qwen3-vl", "sdpa")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, _loader(produced))
    for batch in loader:
        accelerator.backward(model(**batch).loss)
        optimizer.step()
        break


def raw_step(produced: list, output_dir: str) -> None:
    from example_common import load_model

    if "WORLD_SIZE" in os.environ and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")
    model = load_model("tiny-qwen3-vl", "sdpa")
    for batch in _loader(produced):
        model(**vlmcp_patch.batch_to_device(batch, torch.device("cpu"))).loss.backward()
        break


STACKS = {"trainer": trainer_step, "trl_sft": trl_sft_step, "accelerate": accelerate_step, "raw": raw_step}


def main(out: str, stacks: list[str]) -> None:
    results = {}
    for name in stacks:
        produced = []
        with tempfile.TemporaryDirectory() as output_dir, DeviceMoves() as probe:
            STACKS[name](produced, output_dir)
        results[name] = {"produced": produced, "moved": probe.moved}
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    from example_common import finish_distributed

    finish_distributed()
