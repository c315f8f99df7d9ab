"""An HF Trainer script whose model the package does not run under CP (a plain Qwen3 causal LM), launched
with VLMCP_CP_SIZE=2: the Trainer must refuse it when it is built, before any step.

    VLMCP_CP_SIZE=2 torchrun --nproc-per-node 2 -m tests.helpers.run_script tests/helpers/unsupported_trainer_script.py
"""

from __future__ import annotations

import torch
from transformers import Trainer, TrainingArguments

import vlmcp_patch  # noqa: F401
from tests.helpers.error_cases import SCENARIOS


def main() -> None:
    args = TrainingArguments(output_dir="out/unsupported", max_steps=1, per_device_train_batch_size=1, report_to=[],
                             use_cpu=True, logging_steps=1)
    data = [{"input_ids": torch.randint(1, 100, (12,)), "labels": torch.randint(1, 100, (12,))} for _ in range(4)]
    trainer = Trainer(model=SCENARIOS["unsupported_model"](0)[0], args=args, train_dataset=data)
    trainer.train()
    print([e for e in trainer.state.log_history if "loss" in e])


if __name__ == "__main__":
    main()
