"""Fine-tune Qwen3-VL with TRL's `SFTTrainer`: the script is stock TRL except for `import vlmcp_patch`.

    # P=1 reference, one process
    python examples/trl_sft.py --save-weights p1.pt
    # the same training with each sequence split over 2 ranks (DDP over gloo on CPU, NCCL on GPUs)
    VLMCP_CP_SIZE=2 torchrun --nproc-per-node 2 examples/trl_sft.py --save-weights cp2.pt

The data set is conversational image-text ("messages" + "images", some samples text-only) and
`SFTTrainer` uses its own vision collator (`DataCollatorForVisionLanguageModeling`), which runs the
processor's chat template and image processor on the fly. Everything is built in code: the embedded tiny
random-init Qwen3-VL, a character-level tokenizer and the stock Qwen3-VL processor logic around them
(`vlmcp_patch.fixtures.processor`), PIL images. On GPUs, `--model Qwen/Qwen3-VL-2B-Instruct --attn
flash_attention_2 --bf16` fine-tunes a released checkpoint with its own processor on the same data.
Rank 0 prints the logged loss and metrics of every step.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from datasets import Dataset
from example_common import describe_wrapper, finish_distributed, full_state_dict, load_model
from trl import SFTConfig, SFTTrainer

import vlmcp_patch  # the one line that adds context parallelism
from vlmcp_patch.fixtures.data import make_image
from vlmcp_patch.fixtures.processor import tiny_processor

# (question, answer, sizes (width, height) of the images shown before the question)
CONVERSATIONS = [
    ("What is in the picture?", "A blue box on stripes.", [(32, 24)]),
    ("Compare the two images.", "The left one is wider; both have a box.", [(16, 16), (24, 40)]),
    ("Say hello.", "Hello! How can I help you today?", []),
    ("Describe the colors.", "Mostly red with a purple square.", [(16, 32)]),
    ("Count the stripes.", "About ten thin stripes.", [(40, 16)]),
    ("Write a short poem.", "Rain on the window, light in the hall.", []),
]


def image_text_dataset(n: int, seed: int = 0) -> Dataset:
    rows = []
    for i in range(n):
        question, answer, sizes = CONVERSATIONS[i % len(CONVERSATIONS)]
        rows.append({
            "images": [make_image(w, h, seed=seed + 10 * i + j) for j, (w, h) in enumerate(sizes)],
            "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
        })
    return Dataset.from_list(rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-qwen3-vl",
                        help="tiny-qwen3-vl | a checkpoint, e.g. Qwen/Qwen3-VL-2B-Instruct")
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "flash_attention_2"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=2, help="per device")
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--optim", default="adamw_torch", help="any TrainingArguments.optim, e.g. sgd")
    parser.add_argument("--loss-type", help="SFTConfig.loss_type (default: TRL's), e.g. nll")
    parser.add_argument("--samples", type=int, default=24)
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision (TRL's default on GPUs)")
    parser.add_argument("--fsdp", action="store_true", help="train with FSDP2 (parameters sharded over all ranks)")
    parser.add_argument("--output-dir", default="out/trl_sft")
    parser.add_argument("--save-weights", help="rank 0 saves the trained state dict here (for comparisons)")
    parser.add_argument("--save-logs", help="rank 0 saves the trainer's log history here (json)")
    args = parser.parse_args(argv)

    model = load_model(args.model, args.attn)
    if args.model == "tiny-qwen3-vl":
        processor = tiny_processor()
    else:  # a released checkpoint, e.g. Qwen/Qwen3-VL-2B-Instruct
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(args.model)
    on_cpu = not torch.cuda.is_available()
    if args.fsdp and on_cpu:  # accelerate would otherwise run FSDP on CPU as plain multi-CPU
        from vlmcp_patch.fixtures.cpu import configure_cpu_state

        configure_cpu_state("FSDP")
    loss = {"loss_type": args.loss_type} if args.loss_type else {}  # TRL 1.4 to 1.14 under CP: "nll"
    config = SFTConfig(
        **loss,
        output_dir=args.output_dir,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        max_steps=args.steps,
        learning_rate=args.lr,
        optim=args.optim,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        bf16=args.bf16,
        use_cpu=on_cpu and not args.fsdp,
        fsdp=args.fsdp,
        fsdp_config={"fsdp_version": 2} if args.fsdp else None,
        accelerator_config={"use_configured_state": True} if args.fsdp and on_cpu else None,
        dataloader_drop_last=True,
        seed=0,
    )
    if args.fsdp and on_cpu:
        from vlmcp_patch.fixtures.cpu import configure_cpu_fsdp_state

        configure_cpu_fsdp_state(config.fsdp_plugin_args, config.parallelism_config, config.mixed_precision)
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=image_text_dataset(args.samples),
        processing_class=processor,
        callbacks=[vlmcp_patch.VLMCPCallback()],  # optional: setup checks and CP facts in the logs
    )
    trainer.train()
    state = full_state_dict(trainer.model, trainer.accelerator) if args.save_weights else None
    wrapper = describe_wrapper(trainer.model_wrapped, trainer.model)
    if int(os.environ.get("RANK", "0")) == 0:
        logs = [entry for entry in trainer.state.log_history if "loss" in entry]
        for entry in logs:
            print(
                f"step {entry['step']}: loss {entry['loss']:.6f} grad_norm {entry['grad_norm']:.6f} "
                f"entropy {entry['entropy']:.6f} mean_token_accuracy {entry['mean_token_accuracy']:.6f} "
                f"num_tokens {entry['num_tokens']:.0f}"
            )
        print(f"model wrapped by: {wrapper}")
        if args.save_logs:
            with open(args.save_logs, "w") as f:
                json.dump([*logs, {"wrapper": wrapper}], f)
        if args.save_weights:
            torch.save(state, args.save_weights)


if __name__ == "__main__":
    main()
    finish_distributed()
