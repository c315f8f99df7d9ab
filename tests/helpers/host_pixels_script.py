"""Host pixel values at 1/P through each training stack: one step of the HF Trainer (DDP), a raw Accelerate loop (a
prepared data loader) and a raw loop with `batch = vlmcp_patch.batch_to_device(batch, device)`, on a data set of one
micro-batch (two samples; images and a video); and Accelerate's loop over two such micro-batches (`accelerate_prefetch`:
the second one prefetched while the first runs).

    [VLMCP_CP_SIZE=2 torchrun --nproc-per-node 2] tests/helpers/host_pixels_script.py OUT_DIR STACK...

Each rank measures the pixel-value bytes alive in its process while the vision tower runs
(`host_pixel_cases.PixelBytesProbe`) and writes them with the batch's whole pixel bytes and the bound (`pixel_bound`) to
OUT_DIR/STACK.rankR.json; rank 0 saves the step's gradients to OUT_DIR/STACK.pt, as the optimizer would apply them:
the HF Trainer's and Accelerate's after their data-parallel reduction, the raw loop's summed over the CP group.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

import vlmcp_patch
from tests.helpers.host_pixel_cases import PixelBytesProbe, pixel_bound
from vlmcp_patch.fixtures.data import PaddingCollator, Segment as S, build_sample, image_processor
from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_vl_config

# Two samples: two equal images each, the second also a video of four temporal patch groups. At P=2 the images
# split two and two, the video one group per rank pair (the share by items balances for both modalities).
LAYOUTS = [
    [S(text=5), S(image=(16, 16)), S(text=3), S(image=(16, 16)), S(text=2)],
    [S(text=4), S(image=(16, 16)), S(text=3), S(video=(8, 16, 16)), S(text=2), S(image=(16, 16)), S(text=3)],
]


class LazySamples(torch.utils.data.Dataset):
    """The samples of LAYOUTS (`repeats` times over: one micro-batch of two samples each time), each processed when
    it is read (as a data set that decodes its media on access does: nothing of it held between reads)."""

    def __init__(self, repeats: int = 1):
        self.repeats = repeats

    def __len__(self) -> int:
        return len(LAYOUTS) * self.repeats

    def __getitem__(self, index: int):
        if not 0 <= index < len(self):
            raise IndexError(index)
        index %= len(LAYOUTS)
        return build_sample(LAYOUTS[index], seed=11 + index, processor=image_processor())


def _samples(repeats: int = 1) -> LazySamples:
    return LazySamples(repeats)


def _model():
    return build_model(tiny_qwen3_vl_config(), seed=5)


def _grads(model) -> dict:
    """The gradients by parameter name, without a data-parallel wrapper's prefix."""
    return {n.removeprefix("module."): p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def _one_trainer_step(output_dir: str, dataset, collator, batch_size: int) -> tuple[PixelBytesProbe, dict]:
    """One HF Trainer (DDP) step of the test model over `dataset`: the pixel-bytes probe and the gradients the
    optimizer would apply."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    grads = {}

    class KeepGradients(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads.update(_grads(model))

    model = _model()
    probe = PixelBytesProbe(model)
    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=batch_size, max_steps=1,
                             learning_rate=1e-3, optim="sgd", report_to=[], save_strategy="no", use_cpu=True, seed=0,
                             remove_unused_columns=False)
    Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator, callbacks=[KeepGradients()]).train()
    return probe, grads


def trainer_step(output_dir: str) -> tuple[PixelBytesProbe, dict]:
    return _one_trainer_step(output_dir, _samples(), PaddingCollator(), batch_size=2)


def accelerate_step(output_dir: str, batches: int = 1) -> tuple[PixelBytesProbe, dict]:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = _model()
    probe = PixelBytesProbe(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(_samples(batches), batch_size=2, collate_fn=PaddingCollator())
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for batch in loader:
        accelerator.backward(model(**batch).loss)
        del batch
    return probe, _grads(model)


def raw_step(output_dir: str) -> tuple[PixelBytesProbe, dict]:
    from vlmcp_patch.distributed import get_cp_group
    from vlmcp_patch.fixtures.compare import summed_over_group

    model = _model()
    probe = PixelBytesProbe(model)
    for batch in torch.utils.data.DataLoader(_samples(), batch_size=2, collate_fn=PaddingCollator()):
        batch = vlmcp_patch.batch_to_device(batch, torch.device("cpu"))
        model(**batch).loss.backward()
        del batch
    cp = get_cp_group()
    return probe, summed_over_group(_grads(model), None if cp is None else cp.group)


def accelerate_prefetch_step(output_dir: str) -> tuple[PixelBytesProbe, dict]:
    """Two micro-batches: while the first runs, Accelerate's loader holds the second, prefetched (cut as it was
    collated, or whole where only `send_to_device` cuts)."""
    return accelerate_step(output_dir, batches=2)


class ShareDecodingCollator:
    """The row of `share_decode_cases` from its recipe (the text, lazily opened image files, a video's grid and group
    decoder), built by `vlmcp_patch.ShareDecoding`: each rank decodes only its share; what it decoded is counted."""

    def __init__(self):
        from tests.helpers import share_decode_cases as cases

        self.cases, self.decodes = cases, cases.Decodes()

    def __call__(self, features):
        cases = self.cases
        batch = dict(vlmcp_patch.ShareDecoding(cases.processor_with_videos())(
            text=cases.TEXT, images=cases.images(self.decodes), videos=[cases.video_item(self.decodes)],
            return_mm_token_type_ids=True))
        batch["labels"] = batch["input_ids"].masked_fill(batch["mm_token_type_ids"] != 0, -100)
        return batch


def trainer_share_decode_step(output_dir: str) -> tuple[PixelBytesProbe, dict, dict]:
    """One HF Trainer step on `share_decode_cases`' row, collated by `ShareDecodingCollator`; its facts: the whole
    row's pixel bytes and bound, and the groups and images this rank decoded."""
    from tests.helpers import share_decode_cases as cases

    collator = ShareDecodingCollator()
    probe, grads = _one_trainer_step(output_dir, [{"recipe": 0}], collator, batch_size=1)
    facts = pixel_bound(cases.build(1, 0)[0], vlmcp_patch.cp_size())
    return probe, grads, {**facts, "groups": sorted(set(collator.decodes.groups)),
                          "images": sorted(set(collator.decodes.images))}


STACKS = {"trainer": trainer_step, "accelerate": accelerate_step, "raw": raw_step,
          "accelerate_prefetch": accelerate_prefetch_step, "trainer_share_decode": trainer_share_decode_step}


def main(out: str, stacks: list[str]) -> None:
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = int(os.environ.get("RANK", "0"))
    facts = pixel_bound(PaddingCollator()(list(_samples())), vlmcp_patch.cp_size())
    for name in stacks:
        with tempfile.TemporaryDirectory() as output_dir:
            probe, grads, *own_facts = STACKS[name](output_dir)
        probe.remove()
        Path(out, f"{name}.rank{rank}.json").write_text(json.dumps({**(own_facts or [facts])[0], "alive": probe.most}))
        if rank == 0:
            torch.save(grads, Path(out, f"{name}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    if dist.is_initialized():
        dist.barrier()  # every rank done before any tears its connections down
        dist.destroy_process_group()
