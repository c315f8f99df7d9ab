"""The per-rank decode (`vlmcp_patch/share_decode.py`): each rank of a CP group decodes and processes only the images
and video groups it encodes, with the processor's own tokens for the whole rows.

In one process: with no cut the batch equals the processor's own output bit for bit; each rank's pixel values are
exactly its rows of the whole (the record's), only its items and groups are decoded, and the ranks' rows tile the
whole. In a group: the loss and every gradient (summed over the group) equal stock at P=1 on the processor's whole
batch; ranks given different recipes raise on every rank before compute; pixel values decoded in a bf16 model's dtype
give the same step bit for bit. Through the HF Trainer, a collator that calls it holds only the rank's share and steps
as one process."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch

from tests.helpers import share_decode_cases as cases
from tests.helpers.harness import ROOT, launch, run_distributed
from vlmcp_patch.fixtures.processor import tiny_processor
from vlmcp_patch.forward.arguments import SHARE_RECORDS
from vlmcp_patch.forward.host_pixels import FINGERPRINT, RANK, SIZE, START, STOP, WHOLE
from vlmcp_patch.share_decode import ShareDecoding, image_grid

PIXELS = ("pixel_values", "pixel_values_videos")
SCRIPT = ROOT / "tests" / "helpers" / "host_pixels_script.py"


def test_without_a_cut_the_batch_is_the_processors_own(tmp_path):
    from vlmcp_patch.fixtures.data import make_image

    processor = tiny_processor()
    pictures = [make_image(w, h, seed=i) for i, (w, h) in enumerate([(40, 30), (64, 64), (100, 20), (33, 77)])]
    text = ["a <|vision_start|><|image_pad|><|vision_end|> b <|vision_start|><|image_pad|><|vision_end|> c",
            "<|vision_start|><|image_pad|><|vision_end|>d<|vision_start|><|image_pad|><|vision_end|> e"]
    stock = processor(text=text, images=pictures, return_tensors="pt", padding=True)
    ours = ShareDecoding(processor)(text=text, images=pictures, padding=True)  # no CP group: no cut
    assert sorted(ours) == sorted(stock)
    for key in stock:
        assert torch.equal(ours[key], stock[key]), key


@pytest.mark.parametrize("size, height, width", [(1, 30, 40), (1, 77, 33), (1, 20, 100), (1, 512, 3), (1, 8, 8)])
def test_an_images_grid_from_its_size_is_the_processors(size, height, width):
    from vlmcp_patch.fixtures.data import image_processor, make_image

    processor = image_processor()
    stock = processor(images=[make_image(width, height, seed=1)], return_tensors="pt")["image_grid_thw"][0]
    assert list(image_grid(processor, height, width)) == stock.tolist()


@pytest.mark.parametrize("size", [2, 3, 4])
def test_each_rank_decodes_its_rows_only_and_the_ranks_tile_the_whole(size):
    reference, everything = cases.build(1, 0)
    assert sorted(set(everything.images)) == [0, 1, 2, 3] and everything.groups == list(range(cases.GROUPS))
    covered = {key: torch.zeros(reference[key].shape[0], dtype=torch.bool) for key in PIXELS}
    for rank in range(size):
        batch, decodes = cases.build(size, rank)
        for key in ("input_ids", "attention_mask", "mm_token_type_ids", "image_grid_thw", "video_grid_thw"):
            assert torch.equal(batch[key], reference[key]), key
        records = {key: batch.get(SHARE_RECORDS[key]) for key in PIXELS}
        if size == 3:  # four images and eight groups over three ranks do not balance: decoded whole, no record
            assert all(record is None for record in records.values())
            assert torch.equal(batch["pixel_values"], reference["pixel_values"])
            continue
        for key, record in records.items():
            start, stop = int(record[START]), int(record[STOP])
            assert [int(record[SIZE]), int(record[RANK]), int(record[WHOLE])] == [size, rank, reference[key].shape[0]]
            assert torch.equal(batch[key], reference[key][start:stop])
            covered[key][start:stop] = True
        per_group = 16  # a group's rows: (16 / 4) ** 2 patches
        video = records["pixel_values_videos"]
        assert decodes.groups == list(range(int(video[START]) // per_group, int(video[STOP]) // per_group))
        image = records["pixel_values"]
        assert sorted(set(decodes.images)) == list(range(int(image[START]) // 16, int(image[STOP]) // 16))
    if size != 3:
        assert all(bool(mask.all()) for mask in covered.values())


def test_the_recipe_digest_names_the_items_and_the_dtype():
    digests = {}
    for name, (key, dtype) in {"same": ("video-0", None), "again": ("video-0", None), "other video": ("video-1", None),
                               "bf16": ("video-0", torch.bfloat16)}.items():
        batch, _ = cases.build(2, 0, key=key, dtype=dtype)
        digests[name] = batch[SHARE_RECORDS["pixel_values_videos"]][FINGERPRINT:].tolist()
    assert digests["same"] == digests["again"]
    assert digests["other video"] != digests["same"] and digests["bf16"] != digests["same"]


def test_a_source_that_gives_other_rows_raises_naming_it():
    from vlmcp_patch.share_decode import VideoItem

    # no metadata: nothing to check its grid against before its rows (a grid its metadata contradicts raises first:
    # tests/test_share_decode_video.py)
    short = VideoItem(grid=(4, 4, 4), rows=lambda first, count: torch.zeros(count * 15, 96), key="short-video")
    with pytest.raises(ValueError, match=r"short-video.*groups 2\.\.3.*\(32, 96\)"):
        ShareDecoding(cases.processor_with_videos(), size=2, rank=1)(
            text=["<|vision_start|><|video_pad|><|vision_end|>"], videos=[short])


@pytest.mark.parametrize("size", [2, 4])
def test_decoded_shares_train_as_stock_p1(size):
    results = run_distributed(cases.run_decoded_share, size, timeout=300)
    for rank, r in enumerate(results):
        assert r["same_params"] and r["loss_error"] <= cases.TOL and r["grad_error"] <= cases.TOL, (rank, r)
        assert all(r["rows"][k] * size == r["whole_rows"][k] for k in PIXELS), r  # equal items: 1/P each
        assert len(r["groups"]) == cases.GROUPS // size and len(set(r["images"])) == 4 // size
    assert sorted(g for r in results for g in r["groups"]) == list(range(cases.GROUPS))


def test_ranks_with_other_recipes_raise_on_every_rank_before_compute():
    results = run_distributed(cases.run_other_recipes, 2, timeout=300)
    for r in results:
        assert r["error"] is not None and "CPInputError" in r["error"] and "pixel_values_videos" in r["error"], r
    assert results[0]["then"] == pytest.approx(results[1]["then"])


def test_pixel_values_in_the_patch_embeddings_dtype_give_the_same_step():
    for r in run_distributed(cases.run_pixel_dtype, 2, timeout=300):
        assert r == {"dtype": "torch.bfloat16", "same_loss": True, "same_grads": True}


def _trainer_run(cp_size: int) -> Path:
    out = Path(tempfile.mkdtemp(prefix="share-decode-"))
    procs, launcher = (cp_size, "torchrun") if cp_size > 1 else (1, "python")
    run = launch(SCRIPT, [out, "trainer_share_decode"], procs=procs, launcher=launcher,
                 env={"VLMCP_CP_SIZE": str(cp_size)}, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return out


def test_the_hf_trainer_steps_on_decoded_shares_as_one_process(once):
    """A data collator that calls `ShareDecoding`: under CP each rank decodes and holds only its share (the pixel bytes
    alive at the tower within the bound, below the whole), and the Trainer's gradients equal one process's, whose
    collator decoded everything (the control: it holds the whole row's pixel values)."""
    from vlmcp_patch.fixtures.compare import gradient_errors

    cut, stock = once(_trainer_run, 2), once(_trainer_run, 1)
    ranks = [json.loads((cut / f"trainer_share_decode.rank{rank}.json").read_text()) for rank in range(2)]
    for held in ranks:
        assert held["alive"] <= held["bound"] < held["whole"], held
        assert len(held["groups"]) == cases.GROUPS // 2 and len(held["images"]) == 2, held
    assert sorted(ranks[0]["groups"] + ranks[1]["groups"]) == list(range(cases.GROUPS))
    whole = json.loads((stock / "trainer_share_decode.rank0.json").read_text())
    assert whole["alive"] >= whole["whole"] and len(whole["groups"]) == cases.GROUPS, whole
    grads, reference = torch.load(cut / "trainer_share_decode.pt"), torch.load(stock / "trainer_share_decode.pt")
    assert sorted(grads) == sorted(reference)
    assert max(gradient_errors(grads, reference)[0].values()) <= cases.TOL


@pytest.mark.parametrize("size", [2, 4])
def test_decoding_a_share_holds_the_share_and_one_call_where_the_cut_held_the_whole(size):
    """The most pixel bytes alive while a rank decodes: at most its share of each modality plus one call's rows (one
    temporal group here); the control, the whole row decoded then cut (`keep_pixel_share`), holds the whole and the
    share at once."""
    from vlmcp_patch.forward.host_pixels import keep_pixel_share

    whole, _ = cases.build(1, 0)
    whole_bytes = sum(whole[key].nbytes for key in PIXELS)
    group_bytes = 16 * cases.PIXEL_WIDTH * 4  # one temporal group's rows, fp32
    del whole
    for rank in range(size):
        batch, decodes = cases.build(size, rank, measuring=True, groups_per_call=1)
        share_bytes = sum(batch[key].nbytes for key in PIXELS)
        assert share_bytes * size == whole_bytes
        assert decodes.most - decodes.before <= share_bytes + group_bytes, (decodes.most, share_bytes, group_bytes)
        del batch
    from tests.helpers.host_pixel_cases import pixel_bytes_alive

    collated, _ = cases.build(1, 0)
    cut = keep_pixel_share(collated, size, 0)
    assert pixel_bytes_alive(cases.PIXEL_WIDTH) >= whole_bytes + whole_bytes / size
    del cut


def test_the_benchmark_measures_the_decode_below_the_whole_row_decode(capsys):
    """`python -m benchmarks.host_pixels --measure` (docs/memory.md's numbers): a line per rank of P = 2 and 4, each
    with less alive decoding the share than decoding the whole row and cutting it."""
    import re
    import sys

    from benchmarks import host_pixels

    argv, sys.argv = sys.argv, ["host_pixels", "--measure"]
    try:
        host_pixels.main()
    finally:
        sys.argv = argv
    lines = re.findall(r"P=(\d) rank (\d): decoded whole then cut +([\d,]+) B; decoding its share +([\d,]+) B "
                       r"\(its share ([\d,]+) B\)", capsys.readouterr().out)
    assert [(int(p), int(r)) for p, r, *_ in lines] == [(2, 0), (2, 1), (4, 0), (4, 1), (4, 2), (4, 3)]
    for *_, cut, share_decode, share in lines:
        cut, share_decode, share = (int(n.replace(",", "")) for n in (cut, share_decode, share))
        assert share <= share_decode < cut


def test_a_pickled_decoder_carries_its_processs_cut_to_spawned_workers():
    """DataLoader workers started by spawn or forkserver have no process group: the collator pickled for them carries
    the training process's cut (fork workers inherit the group itself)."""
    results = run_distributed(cases.run_pickled, 2, timeout=300)
    assert [r["under_cp"] for r in results] == [(2, 0), (2, 1)]
    assert [r["cut_off"] for r in results] == [None, None]


@pytest.mark.integration
def test_dataloader_workers_of_every_start_method_decode_the_ranks_share():
    """One worker started by fork, spawn and forkserver, each collating the row with a collator built in the training
    process: every rank's batch holds half the video's rows, with the record (a spawned worker has no process group:
    the pickled collator brings the training process's cut)."""
    out = Path(tempfile.mkdtemp(prefix="share-decode-workers-"))
    run = launch(ROOT / "tests" / "helpers" / "share_decode_workers_script.py", [out], procs=2,
                 env={"VLMCP_CP_SIZE": "2"}, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    whole = cases.GROUPS * 16
    for rank in range(2):
        held = json.loads((out / f"workers.rank{rank}.json").read_text())
        assert held == {method: [whole // 2, True] for method in ("fork", "spawn", "forkserver")}, held


def _pictures(tmp_path, sizes=((40, 30), (64, 64), (100, 20), (33, 77))) -> list[str]:
    from vlmcp_patch.fixtures.data import make_image

    paths = []
    for i, (w, h) in enumerate(sizes):
        paths.append(str(tmp_path / f"picture-{i}.png"))
        make_image(w, h, seed=i).save(paths[-1])
    return paths


TWO_ROWS = ["a <|vision_start|><|image_pad|><|vision_end|> b <|vision_start|><|image_pad|><|vision_end|> c",
            "<|vision_start|><|image_pad|><|vision_end|>d<|vision_start|><|image_pad|><|vision_end|> e"]


@pytest.mark.parametrize("form", ["paths", "lazy", "per_row", "arrays", "tensors", "bounds_set"])
def test_every_image_form_the_processor_takes_gives_its_own_batch(tmp_path, form):
    """Images as paths, lazily opened files, a list per row, numpy arrays and torch tensors (channels first), and a
    processor whose resize bounds were set: with no cut, the processor's own batch bit for bit."""
    import numpy as np
    from PIL import Image

    from vlmcp_patch.fixtures.data import pil_image_processor

    processor, paths = tiny_processor(), _pictures(tmp_path)
    decoded = [Image.open(p).convert("RGB") for p in paths]
    images, stock_images, options = {
        "paths": (paths, decoded, {}),
        "lazy": ([Image.open(p) for p in paths], decoded, {}),
        "per_row": ([[Image.open(p) for p in paths[:2]], [Image.open(p) for p in paths[2:]]], decoded, {}),
        "arrays": ([np.asarray(d) for d in decoded], [np.asarray(d) for d in decoded], {}),
        "tensors": ([torch.from_numpy(np.asarray(d)).permute(2, 0, 1) for d in decoded],
                    [torch.from_numpy(np.asarray(d)).permute(2, 0, 1) for d in decoded], {}),
        "bounds_set": (paths, decoded, {}),
    }[form]
    if form == "bounds_set":
        processor.image_processor = pil_image_processor(**{**processor.image_processor.to_dict(),
                                                           "size": {"shortest_edge": 64, "longest_edge": 32 * 32}})
    stock = processor(text=TWO_ROWS, images=stock_images, return_tensors="pt", padding=True, **options)
    ours = ShareDecoding(processor)(text=TWO_ROWS, images=images, padding=True, **options)
    assert sorted(ours) == sorted(stock)
    for key in stock:
        assert torch.equal(ours[key], stock[key]), key


@pytest.mark.parametrize("options", [
    {"do_normalize": False}, {"merge_size": 1}, {"images_kwargs": {"do_resize": False}}, {"videos_kwargs": {"fps": 1}},
    {"max_pixels": 1024}, {"size": {"longest_edge": 1}}])
def test_an_image_or_video_option_in_the_call_raises_naming_it(tmp_path, options):
    with pytest.raises(ValueError, match=f"was given {next(iter(options))} for this call"):
        ShareDecoding(tiny_processor())(text=TWO_ROWS, images=_pictures(tmp_path), padding=True, **options)


def test_the_digest_names_an_images_content_not_its_name(tmp_path, monkeypatch):
    """The same file by a relative and an absolute path: one key; the same path with other bytes, a decoded image
    drawn on after opening, palette images that differ only in their palette: other keys."""
    from PIL import Image, ImageDraw

    from vlmcp_patch.share_decode import _image_key

    path = _pictures(tmp_path, sizes=((16, 16),))[0]
    monkeypatch.chdir(tmp_path)
    relative, absolute = _image_key(Image.open("picture-0.png")), _image_key(Image.open(path))
    assert relative == absolute and relative.startswith("file-sha256:")
    drawn = Image.open(path)
    drawn.load()
    ImageDraw.Draw(drawn).rectangle((0, 0, 3, 3), fill=(255, 0, 0))
    assert _image_key(drawn) != absolute
    Image.new("RGB", (16, 16), (1, 2, 3)).save(path)
    assert _image_key(Image.open(path)) != absolute
    first, second = Image.new("P", (4, 4), 0), Image.new("P", (4, 4), 0)
    first.putpalette([255, 0, 0] * 256)
    second.putpalette([0, 255, 0] * 256)
    assert _image_key(first) != _image_key(second)


def test_video_metadata_given_as_none_or_a_dict_and_the_callers_left_as_given():
    from transformers.video_utils import VideoMetadata

    from vlmcp_patch.share_decode import VideoItem

    processor, decodes = cases.processor_with_videos(), cases.Decodes()
    given = cases.video_item(decodes)
    indices = list(range(cases.GROUPS * 2 - 1))  # an odd count: the expansion pads the indices it reads
    metadata = VideoMetadata(total_num_frames=len(indices), fps=2.0, frames_indices=indices)
    text = ["<|vision_start|><|video_pad|><|vision_end|>"]
    outputs = {}
    for name, value in {"object": metadata, "dict": {"total_num_frames": len(indices), "fps": 2.0,
                                                     "frames_indices": list(indices)}, "none": None}.items():
        video = VideoItem(given.grid, given.rows, given.key, value)
        outputs[name] = ShareDecoding(processor, size=2, rank=0)(text=text, videos=[video])["input_ids"]
    assert metadata.frames_indices == list(range(cases.GROUPS * 2 - 1))
    assert torch.equal(outputs["object"], outputs["dict"]) and outputs["none"].shape[1] > 0


def test_a_photo_given_as_a_path_turns_by_its_exif_orientation_as_the_processor_loads_it(tmp_path):
    """A JPEG whose EXIF orientation turns it by 90 degrees, given as a path: its grid and rows are the processor's (it
    loads a path with `exif_transpose`), with no cut and on each rank of P=2, where the header alone gives the
    unturned size."""
    from PIL import Image

    from vlmcp_patch.fixtures.data import make_image

    paths = []
    for i, (w, h) in enumerate([(48, 20), (20, 48)]):
        picture = make_image(w, h, seed=i).convert("RGB")
        exif = Image.Exif()
        exif[0x0112] = 6  # rotate 270 on display: width and height swap
        paths.append(str(tmp_path / f"photo-{i}.jpg"))
        picture.save(paths[-1], exif=exif.tobytes(), quality=95)
    processor = tiny_processor()
    text = ["<|vision_start|><|image_pad|><|vision_end|> and <|vision_start|><|image_pad|><|vision_end|>"]
    stock = processor(text=text, images=paths, return_tensors="pt")
    assert stock["image_grid_thw"][0].tolist() != [1, 20 // 4, 48 // 4]  # turned
    ours = ShareDecoding(processor)(text=text, images=paths)
    for key in stock:
        assert torch.equal(ours[key], stock[key]), key
    for rank in range(2):
        share = ShareDecoding(processor, size=2, rank=rank)(text=text, images=paths)
        record = share[SHARE_RECORDS["pixel_values"]]
        assert torch.equal(share["image_grid_thw"], stock["image_grid_thw"])
        assert torch.equal(share["pixel_values"], stock["pixel_values"][int(record[START]):int(record[STOP])])


def test_a_lazily_opened_images_key_does_not_change_once_its_share_is_decoded(tmp_path):
    """The ranks' keys of lazily opened files stay the files' from one epoch to the next: the rank that decodes an
    image decodes it from its file, leaving the caller's object undecoded, so the record's digest is the same on a
    second call (where it used to become the pixels' on the rank that had decoded it)."""
    from PIL import Image

    from vlmcp_patch.share_decode import _image_key

    paths = _pictures(tmp_path, sizes=((16, 16),) * 4)
    images = [Image.open(p) for p in paths]
    keys = [_image_key(image) for image in images]
    text = [" ".join(["<|vision_start|><|image_pad|><|vision_end|>"] * 4)]
    digests = []
    for _ in range(2):  # two epochs
        batch = ShareDecoding(tiny_processor(), size=2, rank=0)(text=text, images=images)
        digests.append(batch[SHARE_RECORDS["pixel_values"]][FINGERPRINT:].tolist())
    assert digests[0] == digests[1]
    assert [_image_key(image) for image in images] == keys and all(image.tile for image in images)
    other = ShareDecoding(tiny_processor(), size=2, rank=1)(text=text, images=[Image.open(p) for p in paths])
    assert other[SHARE_RECORDS["pixel_values"]][FINGERPRINT:].tolist() == digests[0]


def test_a_share_decoded_whole_says_so_once_with_the_reason(tmp_path, caplog):
    """Images that do not balance over the ranks are decoded whole on every rank (correct: the forward shares them by
    patches): logged once, on logger `vlmcp_patch`, with the reason."""
    import logging

    from vlmcp_patch import video_share

    video_share._SAID.discard("whole:pixel_values")
    paths = _pictures(tmp_path, sizes=((64, 48), (64, 48), (80, 60), (64, 48), (80, 60)))
    text = [" ".join(["<|vision_start|><|image_pad|><|vision_end|>"] * 5)]
    with caplog.at_level(logging.WARNING, logger="vlmcp_patch"):
        for _ in range(2):
            batch = ShareDecoding(tiny_processor(), size=2, rank=0)(text=text, images=paths)
    assert SHARE_RECORDS["pixel_values"] not in batch
    said = [r for r in caplog.records if r.name == "vlmcp_patch" and "decoded whole" in r.getMessage()]
    assert len(said) == 1 and "do not split into 2 equal shares" in said[0].getMessage(), caplog.text


@pytest.mark.parametrize("options, owner", [({"fps": 1}, "processor.video_processor.fps"),
                                            ({"videos_kwargs": {"num_frames": 8}},
                                             "processor.video_processor.num_frames"),
                                            ({"do_normalize": False}, "processor.image_processor.do_normalize"),
                                            ({"max_pixels": 1024}, "processor.image_processor.size")])
def test_an_option_in_the_call_names_the_processor_that_owns_it(tmp_path, options, owner):
    with pytest.raises(ValueError, match=f"set {owner}"):
        ShareDecoding(cases.processor_with_videos())(text=TWO_ROWS, images=_pictures(tmp_path), padding=True,
                                                     **options)
