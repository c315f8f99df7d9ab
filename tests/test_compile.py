"""`torch.compile` of a supported model runs under CP from its first forward (the package's checks, agreement and
layout run eagerly; the stock modules compile), with the P=1 loss and gradients."""

from __future__ import annotations

import torch

from tests.helpers.harness import run_distributed
from tests.helpers.parity import TOL


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
