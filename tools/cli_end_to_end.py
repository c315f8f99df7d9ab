"""Inputs for, and the comparison of, end-to-end CLI runs (`swift sft`, `llamafactory-cli train`) on a tiny
random-init Qwen3-VL: what a CLI user has on disk, built from the package's fixtures (nothing downloaded).

    python tools/cli_end_to_end.py inputs DIR            # DIR/model (checkpoint + processor), DIR/data (jsonl, images,
                                                         # LLaMA-Factory's dataset_info.json), DIR/lf.yaml,
                                                         # DIR/swift_tiny_tokens.py
    python tools/cli_end_to_end.py compare REF RUN [RUN ...]   # each an output folder of a CLI run

The commands (docs/testing.md, "CLIs end to end"), each run three times: one process, two processes with
`AUTOWRAPT_BOOTSTRAP=vlmcp_patch VLMCP_CP_SIZE=2`, two processes without them (the control):

    NPROC_PER_NODE=N swift sft --model DIR/model --model_type qwen3_vl --dataset DIR/data/train.jsonl \
      --custom_register_path DIR/swift_tiny_tokens.py --split_dataset_ratio 0 --tuner_type full \
      --torch_dtype float32 --attn_impl sdpa --gradient_checkpointing true --per_device_train_batch_size 1 \
      --gradient_accumulation_steps 2 --max_steps 2 --learning_rate 1e-3 --warmup_ratio 0 \
      --lr_scheduler_type constant --logging_steps 1 --save_steps 2 --save_only_model true --report_to none \
      --dataloader_num_workers 0 --dataset_num_proc 1 --seed 42 --output_dir OUT --add_version false
    FORCE_TORCHRUN=1 NNODES=1 NPROC_PER_NODE=N llamafactory-cli train DIR/lf.yaml output_dir=OUT \
      [dataset=tiny_train_images]

`compare` reads each folder's `trainer_state.json` (the HF Trainer's log: loss and grad_norm per step, searched for
in the folder and its checkpoint-* folders) and the saved weights (`model*.safetensors` of the last checkpoint),
and prints, against REF, the largest relative difference of the logged loss and grad_norm and the largest absolute
difference of the weights (max |w - w_ref| over all tensors), as one JSON line per RUN.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (question, answer, sizes (width, height) of the images shown before the question); one sample text-only
CONVERSATIONS = [
    ("What is in the picture?", "A blue box on stripes.", [(32, 24)]),
    ("Compare the two images.", "The left one is wider; both have a box.", [(16, 16), (24, 40)]),
    ("Say hello.", "Hello! How can I help you today?", []),
    ("Describe the colors.", "Mostly red with a purple square.", [(16, 32)]),
]


# ms-swift's qwen3_vl template hard-codes the released tokenizer's image / video token ids; the tiny model's differ
SWIFT_PLUGIN = '''# ms-swift plugin (--custom_register_path): the qwen3_vl template hard-codes the released tokenizer's image /
# video token ids (151655 / 151656); the tiny model's are 120 / 121 (vlmcp_patch.fixtures.data).
from swift.template.templates.qwen import Qwen3VLTemplate

from vlmcp_patch.fixtures.data import IMAGE_TOKEN_ID, VIDEO_TOKEN_ID

Qwen3VLTemplate.image_token_id = IMAGE_TOKEN_ID
Qwen3VLTemplate.video_token_id = VIDEO_TOKEN_ID
'''

# LLaMA-Factory's defaults otherwise (its own gradient checkpointing on)
LF_CONFIG = """model_name_or_path: {folder}/model
trust_remote_code: true
stage: sft
do_train: true
finetuning_type: full
dataset: tiny_train
dataset_dir: {folder}/data
template: qwen3_vl
cutoff_len: 1024
preprocessing_num_workers: 1
dataloader_num_workers: 0
per_device_train_batch_size: 1
gradient_accumulation_steps: 2
max_steps: 2
learning_rate: 1.0e-3
lr_scheduler_type: constant
warmup_ratio: 0.0
optim: adamw_torch
logging_steps: 1
save_steps: 2
save_only_model: true
report_to: none
bf16: false
seed: 42
overwrite_output_dir: true
"""


def write_checkpoint(folder: Path) -> None:
    """The tiny random-init Qwen3-VL (sdpa, seed 0) and the stock `Qwen3VLProcessor` (the tiny tokenizer, the real
    image processor and the real Qwen3-VL video processor: LLaMA-Factory's plugin reads `processor.video_processor`;
    loading it back needs torchvision)."""
    sys.path.insert(0, str(ROOT))
    from transformers import Qwen3VLProcessor

    from tests.helpers.video_files import video_processor
    from vlmcp_patch.fixtures.data import image_processor
    from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_vl_config
    from vlmcp_patch.fixtures.processor import CHAT_TEMPLATE, tiny_tokenizer

    build_model(tiny_qwen3_vl_config(attn_implementation="sdpa"), seed=0).save_pretrained(folder)
    Qwen3VLProcessor(image_processor=image_processor(), tokenizer=tiny_tokenizer(), video_processor=video_processor(),
                     chat_template=CHAT_TEMPLATE).save_pretrained(folder)


def write_inputs(folder: Path, n: int = 16) -> None:
    from vlmcp_patch.fixtures.data import make_image

    (folder / "model").mkdir(parents=True, exist_ok=True)
    write_checkpoint(folder / "model")
    data = folder / "data"
    (data / "images").mkdir(parents=True, exist_ok=True)
    info = {}
    # train: one conversation in four text-only; train_images: the same with a picture on the text-only ones
    for name, text_only in (("train", True), ("train_images", False)):
        rows = []
        for i in range(n):
            question, answer, sizes = CONVERSATIONS[i % len(CONVERSATIONS)]
            sizes = sizes or ([] if text_only else [(24, 16)])
            paths = []
            for j, (w, h) in enumerate(sizes):
                path = data / "images" / f"{i}_{j}_{w}x{h}.png"
                make_image(w, h, seed=10 * i + j).save(path)
                paths.append(str(path))
            rows.append({"messages": [{"role": "user", "content": "<image>" * len(paths) + question},
                                      {"role": "assistant", "content": answer}],
                         "images": paths})
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (data / f"{name}.json").write_text(json.dumps(rows, indent=1))
        info[f"tiny_{name}"] = {"file_name": f"{name}.json", "formatting": "sharegpt",
                                "columns": {"messages": "messages", "images": "images"},
                                "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                                         "assistant_tag": "assistant"}}
    (data / "dataset_info.json").write_text(json.dumps(info, indent=1))
    (folder / "swift_tiny_tokens.py").write_text(SWIFT_PLUGIN)
    (folder / "lf.yaml").write_text(LF_CONFIG.format(folder=folder))
    print(f"model: {folder / 'model'}\nswift data: {data}/train.jsonl, train_images.jsonl\n"
          f"LLaMA-Factory dataset_dir: {data} (datasets tiny_train, tiny_train_images)")


def _state(folder: Path) -> dict:
    states = sorted(folder.rglob("trainer_state.json"), key=lambda p: p.stat().st_mtime)
    if not states:
        raise SystemExit(f"no trainer_state.json under {folder}")
    return json.loads(states[-1].read_text())


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    files = sorted(folder.glob("model*.safetensors"))
    if not files:
        checkpoints = sorted(folder.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1]))
        if not checkpoints:
            raise SystemExit(f"no saved weights under {folder}")
        files = sorted(checkpoints[-1].glob("model*.safetensors"))
    weights = {}
    for f in files:
        weights.update(load_file(str(f)))
    return weights


def _logged(state: dict, key: str) -> list[float]:
    return [entry[key] for entry in state["log_history"] if key in entry]


def compare(ref: Path, runs: list[Path]) -> None:
    ref_state, ref_weights = _state(ref), _weights(ref)
    for run in runs:
        state, weights = _state(run), _weights(run)
        out = {"run": str(run), "ref": str(ref)}
        for key in ("loss", "grad_norm"):
            a, b = _logged(ref_state, key), _logged(state, key)
            out[key] = {"ref": a, "run": b,
                        "max_rel_diff": max((abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b)), default=None)}
        if set(weights) != set(ref_weights):
            out["weights"] = f"different tensors: {sorted(set(weights) ^ set(ref_weights))[:5]}"
        else:
            out["weights_max_abs_diff"] = max(
                (weights[k].float() - ref_weights[k].float()).abs().max().item() for k in ref_weights)
            out["weights_max_abs"] = max(w.float().abs().max().item() for w in ref_weights.values())
        print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("inputs")
    p.add_argument("folder", type=Path)
    p.add_argument("--n", type=int, default=16)
    p = sub.add_parser("compare")
    p.add_argument("ref", type=Path)
    p.add_argument("runs", type=Path, nargs="+")
    args = parser.parse_args()
    if args.cmd == "inputs":
        write_inputs(args.folder, args.n)
    else:
        compare(args.ref, args.runs)


if __name__ == "__main__":
    main()
