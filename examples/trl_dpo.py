"""Preference training with TRL's `DPOTrainer` (or `KTOTrainer`): a stock TRL script plus `import vlmcp_patch`.

    # one process
    python examples/trl_dpo.py --save-weights p1.pt
    # the same training with each sequence split over 2 ranks
    VLMCP_CP_SIZE=2 torchrun --nproc-per-node 2 examples/trl_dpo.py --save-weights cp2.pt
    # KTO; the reference as PEFT's adapter-disabled policy, or precomputed log-probabilities
    VLMCP_CP_SIZE=2 torchrun --nproc-per-node 2 examples/trl_dpo.py --trainer kto --reference peft
    VLMCP_CP_SIZE=2 torchrun --nproc-per-node 2 examples/trl_dpo.py --reference precomputed

DPO trains on image prompts with a chosen and a rejected answer (`--text`: text-only prompts, which TRL needs to
precompute the reference's log-probabilities), KTO on prompts with one answer labelled desirable or not
(text-only: TRL's KTO has no vision collator). Everything is built in code: the embedded tiny
random-init model, a character-level tokenizer and the stock Qwen3-VL processor logic around it, PIL images.
On GPUs, `--model Qwen/Qwen3-VL-2B-Instruct --attn flash_attention_2 --bf16` trains a released checkpoint.
Rank 0 prints the logged metrics of every step (loss, rewards, margins, accuracies, ...).
"""

from __future__ import annotations

import argparse
import os

import torch
from datasets import Dataset
from example_common import finish_distributed, from_local_checkpoint, load_model, metrics_line, report_run
from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer

import vlmcp_patch  # the one line that adds context parallelism
from vlmcp_patch.fixtures.data import make_image
from vlmcp_patch.fixtures.processor import tiny_processor

TRAINERS = {"dpo": (DPOConfig, DPOTrainer), "kto": (KTOConfig, KTOTrainer)}
# (question, a preferred answer, a worse one, sizes (width, height) of the pictures shown)
PAIRS = [
    ("What is in the picture?", "A blue box on stripes.", "Nothing.", [(32, 24)]),
    ("Which image is wider?", "The first one, clearly.", "No idea", [(16, 16), (24, 40)]),
    ("Describe the colors.", "Mostly red with a purple square.", "Blue?", [(16, 32)]),
    ("Count the stripes.", "About ten thin stripes.", "Two", [(40, 16)]),
]


def user(question: str, images: int) -> list:
    content = [{"type": "image"} for _ in range(images)] + [{"type": "text", "text": question}]
    return [{"role": "user", "content": content}]


def assistant(text: str) -> list:
    return [{"role": "assistant", "content": [{"type": "text", "text": text}]}]


def preference_pairs(n: int) -> Dataset:
    rows = []
    for i in range(n):
        question, good, bad, sizes = PAIRS[i % len(PAIRS)]
        rows.append({"prompt": user(question, len(sizes)), "chosen": assistant(good), "rejected": assistant(bad),
                     "images": [make_image(w, h, seed=10 * i + j) for j, (w, h) in enumerate(sizes)]})
    return Dataset.from_list(rows)


def text_pairs(n: int) -> Dataset:
    rows = []
    for i in range(n):
        question, good, bad, _ = PAIRS[i % len(PAIRS)]
        rows.append({"prompt": [{"role": "user", "content": question}],
                     "chosen": [{"role": "assistant", "content": good}],
                     "rejected": [{"role": "assistant", "content": bad}]})
    return Dataset.from_list(rows)


def unpaired_answers(n: int) -> Dataset:
    rows = []
    for i in range(n):
        question, good, bad, _ = PAIRS[(i // 2) % len(PAIRS)]
        desirable = i % 2 == 0
        rows.append({"prompt": [{"role": "user", "content": question}],
                     "completion": [{"role": "assistant", "content": good if desirable else bad}], "label": desirable})
    return Dataset.from_list(rows)


def on_disk(data: Dataset, path: str) -> Dataset:
    """The data set saved by the main process and loaded by every one: TRL caches the precomputed reference
    log-probabilities beside it, where every process finds them."""
    from accelerate import PartialState
    from datasets import load_from_disk

    state = PartialState()
    with state.main_process_first():
        if state.is_main_process:
            data.save_to_disk(path)
        return load_from_disk(path)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainer", default="dpo", choices=list(TRAINERS))
    parser.add_argument("--model", default="tiny-qwen3-vl", help="tiny-qwen3-vl | tiny-qwen3.5 | a checkpoint")
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "flash_attention_2"])
    parser.add_argument("--reference", default="model", choices=["model", "peft", "precomputed"],
                        help="a separate reference model, PEFT's adapter-disabled policy, or precomputed log-probs")
    parser.add_argument("--text", action="store_true", help="DPO on text-only pairs (KTO always is)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=2, help="per device")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--optim", default="adamw_torch", help="any TrainingArguments.optim, e.g. sgd")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--output-dir", default="out/trl_dpo")
    parser.add_argument("--save-weights", help="rank 0 saves the trained state dict here")
    parser.add_argument("--save-logs", help="rank 0 saves the log history here (json)")
    return parser.parse_args(argv)


def preference_config(args):
    config_class, _ = TRAINERS[args.trainer]
    return config_class(
        output_dir=args.output_dir, per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum, max_steps=args.steps, learning_rate=args.lr, optim=args.optim,
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[], bf16=args.bf16,
        use_cpu=not torch.cuda.is_available(), seed=0, precompute_ref_log_probs=args.reference == "precomputed",
        dataloader_drop_last=True,
        # text-only data leaves a VLM's vision tower unused: DDP must be told (without CP too)
        ddp_find_unused_parameters=True if text_only(args) else None,
    )


def text_only(args) -> bool:
    return args.trainer == "kto" or args.text


def policy(args):
    """The policy, and the reference TRL should use with it."""
    model = load_model(args.model, args.attn)
    if args.model.startswith("tiny"):  # TRL builds a reference model from the policy's checkpoint
        model = from_local_checkpoint(model, args.output_dir)
    if args.reference == "peft":
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(5)
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=r".*language_model.*\.(q_proj|v_proj)|.*\.(q_proj|v_proj)",
                          init_lora_weights=False)
        model = get_peft_model(model, lora)
    return model


def report(args, trainer) -> None:
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    report_run(trainer, args.save_weights, args.save_logs, logs, metrics_line)


def main(argv=None) -> None:
    args = parse_args(argv)
    model = policy(args)
    processor = tiny_processor() if args.model.startswith("tiny") else args.model
    data = unpaired_answers(args.samples) if args.trainer == "kto" else (
        text_pairs(args.samples) if args.text else preference_pairs(args.samples))
    if text_only(args) and args.model.startswith("tiny"):
        processor = processor.tokenizer  # text-only data: the tokenizer
    if args.reference == "precomputed":
        data = on_disk(data, os.path.join(args.output_dir, "data"))
    _, trainer_class = TRAINERS[args.trainer]
    trainer = trainer_class(model=model, args=preference_config(args), train_dataset=data,
                            processing_class=processor,
                            callbacks=[vlmcp_patch.VLMCPCallback()])  # optional: setup checks, CP facts in the logs
    trainer.train()
    report(args, trainer)


if __name__ == "__main__":
    main()
    finish_distributed()
