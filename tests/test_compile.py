"""`torch.compile` of a supported model runs under CP from its first forward (the package's checks, agreement and
layout run eagerly; the stock modules compile), with the P=1 loss and gradients."""

from __future__ import annotations

import pytest

import torch

from tests.helpers.harness import run_distributed
from tests.helpers.parity import TOL

pytestmark = pytest.mark.integration  # the second tier (docs/testing.md)


def _compiled_cp_step(rank, world_size):
    import vlmcp_patch
    from vlmcp_patch.fixtures.compare import rel_err, summed_over_group
    from vlmcp_patch.fixtures.data import Segment as S
    from vlmcp_patch.fixtures.data import make_batch
    from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_vl_config

    model = build_model(tiny_qwen3_vl_config())
    batch = make_batch([[S(text=5), S(image=(16, 16)), S(text=6)]], seed=1)
    reference = model(**batch)
    reference.loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    # Dynamo's tracing and AOT autograd (where the CP forward's Python meets the compiler); inductor's code
    # generation for the stock modules is not what this checks, and costs a minute on CPU.
    compiled = torch.compile(model, backend="aot_eager")
    vlmcp_patch.enable(cp_size=world_size)
    try:
        out = compiled(**batch)  # the first CP forward of this process happens inside the compiled model
        out.loss.backward()
    finally:
        vlmcp_patch.enable(cp_size=1)
    grads = summed_over_group({n: p.grad for n, p in model.named_parameters()}, vlmcp_patch.get_cp_group(2).group)
    own = max(rel_err(p.grad, expected[n]) for n, p in model.named_parameters())
    return rel_err(out.loss, reference.loss), max(rel_err(grads[n], g) for n, g in expected.items()), own


def test_torch_compile_runs_cp_from_the_first_forward():
    for loss_err, grad_err, own_grad_err in run_distributed(_compiled_cp_step, 2, timeout=400):
        assert loss_err <= TOL and grad_err <= TOL
        assert own_grad_err > TOL  # each rank holds only its slice's share: CP really ran


FULLGRAPH_CLASSES = ["Qwen3VLForConditionalGeneration", "Qwen3_5ForCausalLM"]


@pytest.mark.parametrize("name", FULLGRAPH_CLASSES)
def test_with_cp_off_the_patched_forward_traces_like_stock_in_one_graph(name, reapply):
    """transformers' own compile tests trace `model.forward` with fullgraph=True: with the import and CP off the
    patched forward must trace too (no graph break at the package's flags) and give stock's logits, and a second
    call of another length recompiles no more often than stock's does."""
    from vlmcp_patch.fixtures.models import TINY_CONFIGS, build_model

    import vlmcp_patch

    model = build_model(TINY_CONFIGS[name](), seed=3).eval()
    ids = [torch.randint(1, 100, (1, n), generator=torch.Generator().manual_seed(n)) for n in (9, 7)]

    def traced():
        torch._dynamo.reset()
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        compiled = torch.compile(model.forward, fullgraph=True, backend="eager", dynamic=False)
        with torch.no_grad():
            logits = [compiled(input_ids=x, use_cache=False).logits for x in ids]
        return logits, torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs

    ours = _outcome(traced)
    vlmcp_patch.revert()
    stock = _outcome(traced)
    # transformers 5.2's Qwen3.5 branches on a tensor in its own forward: stock does not trace in one graph there, and
    # the patched forward must fail as stock does
    assert ours[1] == stock[1]
    if stock[1] is not None:
        return
    ours, stock = ours[0], stock[0]
    assert all(torch.equal(a, b) for a, b in zip(ours[0], stock[0]))
    assert ours[1] == stock[1]


def _outcome(run) -> tuple:
    """(what `run()` returned, None) or (None, (its exception's type, the first line of its message: the frames a
    tracer's message goes on to list include the package's own))."""
    try:
        return run(), None
    except Exception as exc:  # noqa: BLE001 - compared with stock's, whatever it is
        return None, (type(exc), str(exc).splitlines()[0] if str(exc) else "")


@pytest.mark.parametrize("name", ["Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"])
def test_generate_with_a_static_cache_works_as_stock(name, reapply):
    """Generation with a static cache hands the hybrid Qwen3.5 models a mapping of masks per layer type, which the
    package reads as stock does (before this release it raised on it at P=1)."""
    from vlmcp_patch.fixtures.models import TINY_CONFIGS, build_model

    import vlmcp_patch

    ids = torch.randint(1, 100, (1, 8), generator=torch.Generator().manual_seed(0))

    def run():  # on a model of its own: a generation that raised may leave state behind
        model = build_model(TINY_CONFIGS[name](), seed=3)
        return model.generate(input_ids=ids, max_new_tokens=3, do_sample=False, cache_implementation="static")

    ours = _outcome(run)
    vlmcp_patch.revert()
    stock = _outcome(run)
    # transformers 5.6 cannot build the masks of a static cache for the hybrid models (its generation raises a
    # KeyError, 'linear_attention'): the package then raises stock's own error, no other
    assert ours[1] == stock[1]
    assert stock[1] is not None or torch.equal(ours[0], stock[0])
