"""RL on image prompts with TRL's `GRPOTrainer` (or `RLOOTrainer`): a stock TRL script plus `import vlmcp_patch`.

    # one process
    python examples/trl_grpo.py --save-weights p1.pt
    # the same training with each sequence scored over 2 ranks (rollouts drawn once per CP group)
    VLMCP_CP_SIZE=2 torchrun --nproc-per-node 2 examples/trl_grpo.py --save-weights cp2.pt
    # RLOO, Qwen3.5, a reference model (beta > 0), two optimisation passes per rollout
    VLMCP_CP_SIZE=2 torchrun --nproc-per-node 2 examples/trl_grpo.py --trainer rloo --model tiny-qwen3.5 --beta 0.1 \
        --num-iterations 2

The prompts are conversations with pictures (TRL's vision path needs every prompt of a generation batch to
have one; `--text-only-replica R` gives replica R text-only prompts); the model's own `generate` samples the
completions and a reward on the completion text scores them. Everything is built in code: the embedded
tiny random-init model, a character-level tokenizer and the stock Qwen3-VL processor logic around it, PIL
images. On GPUs, `--model Qwen/Qwen3-VL-2B-Instruct --attn flash_attention_2 --bf16` trains a released
checkpoint with its own processor. With `VLMCP_SPLIT_ROLLOUTS=1` each rank of a CP group generates its share of
the group's completions (faster; other random draws). Rank 0 prints the logged metrics of every step.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from datasets import Dataset
from example_common import finish_distributed, from_local_checkpoint, load_model, metrics_line, report_run
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

import vlmcp_patch  # the one line that adds context parallelism
from vlmcp_patch.fixtures.data import make_image
from vlmcp_patch.fixtures.processor import tiny_processor

TRAINERS = {"grpo": (GRPOConfig, GRPOTrainer), "rloo": (RLOOConfig, RLOOTrainer)}
# (question, sizes (width, height) of the pictures shown before it)
PROMPTS = [
    ("Describe the picture.", [(32, 24)]),
    ("Which image is wider?", [(16, 16), (24, 40)]),
    ("Say something nice about it.", [(24, 24)]),
    ("What colors do you see?", [(16, 32)]),
]


def image_prompts(n: int, text_only: bool = False) -> Dataset:
    """Conversational prompts with their pictures (`text_only`: the same questions without any)."""
    rows = []
    for i in range(n):
        question, sizes = PROMPTS[i % len(PROMPTS)]
        sizes = [] if text_only else sizes
        content = [{"type": "image"} for _ in sizes] + [{"type": "text", "text": question}]
        rows.append({"prompt": [{"role": "user", "content": content}],
                     "images": [make_image(w, h, seed=10 * i + j) for j, (w, h) in enumerate(sizes)]})
    return Dataset.from_list(rows)


class LetterReward:
    """The reward: the share of letters among the completion's characters (a toy; it rarely ties, so the
    group-relative advantages are rarely all zero). It also records the completions it scored."""

    __name__ = "letters"

    def __init__(self):
        self.seen = []

    def __call__(self, prompts, completions, completion_ids, **kwargs):
        self.seen.append([list(ids) for ids in completion_ids])
        texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
        return [sum(ch.isalpha() for ch in t) / max(1, len(t)) for t in texts]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainer", default="grpo", choices=list(TRAINERS))
    parser.add_argument("--model", default="tiny-qwen3-vl", help="tiny-qwen3-vl | tiny-qwen3.5 | a checkpoint")
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "flash_attention_2"])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=2, help="completions per device and step")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--num-generations", type=int, default=2)
    parser.add_argument("--steps-per-generation", type=int, default=None)
    parser.add_argument("--num-iterations", type=int, default=1)
    parser.add_argument("--beta", type=float, default=0.0, help="KL coefficient (> 0: a reference model)")
    parser.add_argument("--loss-type", default=None, help="GRPO: dapo | grpo | dr_grpo | bnpo ...")
    parser.add_argument("--scale-rewards", default="group")
    parser.add_argument("--max-completion-length", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--optim", default="adamw_torch", help="any TrainingArguments.optim, e.g. sgd")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--text-only-replica", type=int, default=-1,
                        help="data-parallel replica whose prompts have no pictures (mixed-modality runs)")
    parser.add_argument("--vllm-mode", choices=["server", "colocate"], help="roll out with vLLM (a server, or one "
                        "engine per process); default: the model's own generate")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--fsdp", action="store_true", help="train with FSDP2")
    parser.add_argument("--deepspeed", help="train with DeepSpeed, this config")
    parser.add_argument("--output-dir", default="out/trl_grpo")
    parser.add_argument("--save-weights", help="rank 0 saves the trained state dict here")
    parser.add_argument("--save-logs", help="rank 0 saves the log history here (json)")
    parser.add_argument("--save-completions", help="each rank saves the completions it scored here (json, RANK added)")
    return parser.parse_args(argv)


def rl_config(args, on_cpu: bool):
    config_class, _ = TRAINERS[args.trainer]
    extra = {"loss_type": args.loss_type} if args.loss_type else {}
    if args.steps_per_generation:
        extra["steps_per_generation"] = args.steps_per_generation
    if args.trainer == "grpo":
        extra["scale_rewards"] = args.scale_rewards
    if args.vllm_mode:
        extra.update(use_vllm=True, vllm_mode=args.vllm_mode)
    sharded = args.fsdp or bool(args.deepspeed)
    return config_class(
        output_dir=args.output_dir, per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum, max_steps=args.steps, learning_rate=args.lr, optim=args.optim,
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[], bf16=args.bf16,
        num_generations=args.num_generations, num_iterations=args.num_iterations, beta=args.beta,
        max_completion_length=args.max_completion_length, use_cpu=on_cpu and not sharded, seed=0,
        fsdp=args.fsdp, fsdp_config={"fsdp_version": 2} if args.fsdp else None, deepspeed=args.deepspeed,
        accelerator_config={"use_configured_state": True} if sharded and on_cpu else None,
        shuffle_dataset=args.text_only_replica < 0,
        # TRL gathers the logged images only on processes that have some: with a text-only replica that gather
        # would wait forever (without CP too), so mixed-modality runs do not log images
        log_multimodal=args.text_only_replica < 0, **extra,
    )


def prompts_of_this_replica(args) -> Dataset:
    """The prompts; in a mixed-modality run (two replicas, one prompt each per generation, in data-set order) every
    other prompt comes without pictures, so that one replica's prompts are all text-only."""
    if args.text_only_replica < 0:
        return image_prompts(args.samples)
    with_pictures, without = image_prompts(args.samples), image_prompts(args.samples, text_only=True)
    rows = [(without if i % 2 == args.text_only_replica else with_pictures)[i] for i in range(args.samples)]
    return Dataset.from_list(rows)


def report(args, trainer, reward: LetterReward) -> None:
    if args.save_completions:  # every rank: the completions it scored
        with open(f"{args.save_completions}.{os.environ.get('RANK', '0')}", "w") as f:
            json.dump(reward.seen, f)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    report_run(trainer, args.save_weights, args.save_logs, logs, metrics_line)


def main(argv=None) -> None:
    args = parse_args(argv)
    on_cpu = not torch.cuda.is_available()
    if (args.fsdp or args.deepspeed) and on_cpu:  # accelerate would otherwise run them as plain multi-CPU
        from vlmcp_patch.fixtures.cpu import configure_cpu_state

        configure_cpu_state("DEEPSPEED" if args.deepspeed else "FSDP")
    model = load_model(args.model, args.attn)
    processor = tiny_processor() if args.model.startswith("tiny") else None
    if processor is not None and args.beta > 0:  # the reference model is loaded from the policy's checkpoint
        model = from_local_checkpoint(model, args.output_dir)
    config = rl_config(args, on_cpu)
    if args.fsdp and on_cpu:
        from vlmcp_patch.fixtures.cpu import configure_cpu_fsdp_state

        configure_cpu_fsdp_state(config.fsdp_plugin_args, config.parallelism_config, config.mixed_precision)
    reward = LetterReward()
    _, trainer_class = TRAINERS[args.trainer]
    trainer = trainer_class(model=model, args=config, reward_funcs=[reward],
                            train_dataset=prompts_of_this_replica(args), processing_class=processor or args.model,
                            callbacks=[vlmcp_patch.VLMCPCallback()])  # optional: setup checks, CP facts in the logs
    trainer.train()
    report(args, trainer, reward)


if __name__ == "__main__":
    main()
    finish_distributed()
