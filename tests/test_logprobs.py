"""`vlmcp_patch.token_log_probs` for custom RL loops equals log_softmax(logits / T).gather(targets) of stock P=1 — the
log-probabilities, the entropies and every gradient of a loss made from them (summed over the group) — at P=1, 2
and 4, with a temperature, padding on either side, images, a packed row and Qwen3.5; and no rank ever holds a
(tokens x vocabulary) tensor beyond one chunk of the head."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tests.helpers.harness import run_distributed
from tests.helpers.parity import TOL
from vlmcp_patch.fixtures.compare import rel_err

CHUNK = 4  # tokens per chunk of the head in these runs
VOCAB = 131


class VocabularyRows(TorchDispatchMode):
    """The most rows of any newly allocated tensor whose last dimension is the vocabulary."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.most = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {x.untyped_storage().data_ptr() for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)}
        for t in tree_leaves(out):
            allocated = isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs  # not a view
            if allocated and t.ndim and t.shape[-1] == self.vocab:
                self.most = max(self.most, t.numel() // self.vocab)
        return out


def _batches():
    from vlmcp_patch.fixtures.data import Segment as S
    from vlmcp_patch.fixtures.data import make_batch, make_packed_batch
    from vlmcp_patch.fixtures.models import tiny_qwen3_5_config, tiny_qwen3_vl_config

    pair = make_batch([[S(text=5), S(image=(16, 16)), S(text=6)], [S(text=9)]], seed=2, labels=False)
    left = dict(pair)
    lengths = pair["attention_mask"].sum(1)
    for key in ("input_ids", "mm_token_type_ids", "attention_mask"):
        left[key] = torch.stack([row.roll(int(pair[key].shape[1] - n)) for row, n in zip(pair[key], lengths)])
    packed, samples = make_packed_batch([[S(text=6), S(image=(16, 16)), S(text=4)], [S(text=7)]], seed=3)
    packed.pop("labels")
    return {
        "qwen3_vl right-padded": (tiny_qwen3_vl_config(), pair, 1.0, None),
        "qwen3_vl left-padded, T=0.7": (tiny_qwen3_vl_config(), left, 0.7, None),
        "qwen3_vl packed row, T=0.7": (tiny_qwen3_vl_config(), packed, 0.7, samples),
        "qwen3_5 right-padded, T=1.3": (tiny_qwen3_5_config(), pair, 1.3, None),
    }


def _reference(model, batch, targets, temperature, samples=None):
    """The formula on stock's logits (one process); for a packed row, on each of its samples run alone."""
    if samples is not None:
        from vlmcp_patch.logprobs import next_tokens

        parts = [_reference(model, {k: v for k, v in sample.items() if k != "labels"},
                            next_tokens({"input_ids": sample["input_ids"]}), temperature) for sample in samples]
        return tuple(torch.cat(values, dim=1) for values in zip(*parts))
    logits = model(**batch).logits.float() / temperature
    logp = logits.log_softmax(-1)
    valid = targets != -100
    picked = torch.where(valid, logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0], 0.0)
    return picked, torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)


def _loss(log_probs, entropy):
    weights = torch.linspace(-1, 1, log_probs.shape[-1])
    return (log_probs * weights).sum() + 0.3 * entropy.sum()


def _grads(model):
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def compare_log_probs(rank: int, world_size: int) -> dict:
    import vlmcp_patch
    from vlmcp_patch.fixtures.compare import gradient_errors, rel_err, summed_over_group
    from vlmcp_patch.fixtures.models import build_model
    from vlmcp_patch.logprobs import next_tokens

    out = {}
    for name, (config, batch, temperature, samples) in _batches().items():
        config.get_text_config().vocab_size = VOCAB  # a width no other tensor of the tiny models has
        model = build_model(config, seed=1)
        targets = next_tokens(batch)
        vlmcp_patch.revert()
        ref = _reference(model, batch, targets, temperature, samples)
        _loss(*ref).backward()
        ref_grads = _grads(model)
        vlmcp_patch.apply()
        vlmcp_patch.enable(cp_size=world_size, loss_chunk_tokens=CHUNK)
        try:
            with VocabularyRows(VOCAB) as rows:
                got = vlmcp_patch.token_log_probs(model, temperature=temperature, **batch)
                _loss(got.log_probs, got.entropy).backward()
        finally:
            vlmcp_patch.enable(cp_size=1, loss_chunk_tokens=0)
        cp = vlmcp_patch.get_cp_group(world_size)
        grads = summed_over_group(_grads(model), None if cp is None else cp.group)
        grad_errs, _ = gradient_errors(grads, ref_grads)
        out[name] = {"log_probs": rel_err(got.log_probs, ref[0]), "entropy": rel_err(got.entropy, ref[1]),
                     "grads": max(grad_errs.values()), "missing": sorted(set(ref_grads) - set(grads)),
                     "vocabulary_rows": rows.most, "shape": tuple(got.log_probs.shape) == tuple(targets.shape)}
    return out


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_token_log_probs_equal_the_formula_on_stock_logits(cp_size, once):
    for rank, res in enumerate(once(run_distributed, compare_log_probs, cp_size)):
        for name, m in res.items():
            where = (name, cp_size, rank)
            assert m["shape"] and m["missing"] == [], where
            assert m["log_probs"] <= TOL and m["entropy"] <= TOL and m["grads"] <= TOL, (where, m)
            assert 0 < m["vocabulary_rows"] <= CHUNK, (where, m)  # one chunk of logits at a time, never the row


@pytest.mark.parametrize("off", ["disabled", "reverted"])
def test_token_log_probs_where_stocks_forward_runs(off, reapply):
    """Inside `vlmcp_patch.disabled()` and with the package reverted the model's own forward runs: the same values
    from its full logits (the package's chunked head does not take part)."""
    import vlmcp_patch
    from vlmcp_patch.fixtures.models import build_model
    from vlmcp_patch.logprobs import next_tokens, token_log_probs

    config, batch, temperature, _ = _batches()["qwen3_vl left-padded, T=0.7"]
    model = build_model(config, seed=1)
    targets = next_tokens(batch)
    expected = _reference(model, batch, targets, temperature)
    if off == "reverted":
        vlmcp_patch.revert()
    with vlmcp_patch.disabled() if off == "disabled" else contextlib.nullcontext():
        got = token_log_probs(model, temperature=temperature, **batch)
    assert rel_err(got.log_probs, expected[0]) <= TOL and rel_err(got.entropy, expected[1]) <= TOL
