"""CUDA checks (run by scripts/gpu_check.sh on a lent GPU, which fails on any skip; skipped where no GPU)."""

from __future__ import annotations

import io

import pytest
import torch

import gefen
from gefen.state import FIRST_MOMENT_CODES

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check.sh)"),
]


def _params(device, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    shapes = [(256, 128), (384, 96), (1000,), (64, 3, 3, 3)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(device=device, dtype=dtype)) for s in shapes]


def _grads(params, step):
    gen = torch.Generator().manual_seed(100 + step)
    return [
        torch.randn(p.shape, generator=gen) * torch.rand(p.shape[0], *([1] * (p.dim() - 1)), generator=gen)
        for p in params
    ]


def test_cuda_steps_match_cpu_steps():
    cpu, cuda = _params("cpu"), _params("cuda")
    opt_cpu = gefen.Gefen(cpu, lr=1e-2, weight_decay=0.1)
    opt_cuda = gefen.Gefen(cuda, lr=1e-2, weight_decay=0.1)
    for s in range(5):
        for p_cpu, p_cuda, g in zip(cpu, cuda, _grads(cpu, s)):
            p_cpu.grad, p_cuda.grad = g.clone(), g.cuda()
        opt_cpu.step()
        opt_cuda.step()
    assert torch.equal(opt_cpu.codebook, opt_cuda.codebook.cpu())
    for p_cpu, p_cuda in zip(cpu, cuda):
        assert opt_cuda.state[p_cuda][FIRST_MOMENT_CODES].device.type == "cuda"
        codes_cpu = opt_cpu.state[p_cpu][FIRST_MOMENT_CODES]
        codes_cuda = opt_cuda.state[p_cuda][FIRST_MOMENT_CODES].cpu()
        assert (codes_cpu != codes_cuda).float().mean() < 1e-3  # reductions differ by rounding only
        torch.testing.assert_close(p_cuda.detach().cpu(), p_cpu.detach(), rtol=1e-4, atol=1e-5)


def test_cuda_checkpoint_resumes_bit_exactly_and_loads_on_cpu():
    params = _params("cuda")
    opt = gefen.Gefen(params, lr=1e-2)
    for s in range(2):
        for p, g in zip(params, _grads(params, s)):
            p.grad = g.cuda()
        opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = gefen.Gefen(copies, lr=1e-2)
    resumed.load_state_dict(saved)
    for s in range(2, 4):
        for p, q, g in zip(params, copies, _grads(params, s)):
            p.grad, q.grad = g.cuda(), g.cuda()
        opt.step()
        resumed.step()
    assert all(torch.equal(p, q) for p, q in zip(params, copies))
    cpu_params = [torch.nn.Parameter(p.detach().cpu()) for p in params]
    on_cpu = gefen.Gefen(cpu_params, lr=1e-2)
    on_cpu.load_state_dict(saved)
    assert on_cpu.codebook.device.type == "cpu"
    assert all(t.device.type == "cpu" for st in on_cpu.state.values() for t in st.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_low_precision_params_train(dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    model = model.to(device="cuda", dtype=dtype)
    opt = gefen.Gefen(model.parameters(), lr=3e-3)
    x = torch.randn(128, 64, device="cuda", dtype=dtype)
    losses = []
    for _ in range(30):
        loss = (model(x).float() - x.float()).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_compiled_step_matches_eager_step(dtype):
    """The Triton kernels (fused=True) against the eager twin on the same GPU."""
    eager_params, fused_params = _params("cuda", dtype), _params("cuda", dtype)
    eager = gefen.Gefen(eager_params, lr=1e-2, weight_decay=0.1, fused=False)
    fused = gefen.Gefen(fused_params, lr=1e-2, weight_decay=0.1, fused=True)
    for s in range(5):
        for p, q, g in zip(eager_params, fused_params, _grads(eager_params, s)):
            p.grad, q.grad = g.to("cuda", dtype), g.to("cuda", dtype)
        eager.step()
        fused.step()
    assert len(fused._kernels) > 0 and not fused._kernels.failures
    for p, q in zip(eager_params, fused_params):
        codes_e, codes_f = eager.state[p][FIRST_MOMENT_CODES], fused.state[q][FIRST_MOMENT_CODES]
        assert (codes_e != codes_f).float().mean() < 1e-3  # fp32 division/rounding differences only
        tolerance = 1e-5 if dtype == torch.float32 else 2.0**-7
        torch.testing.assert_close(q.float(), p.float(), rtol=tolerance, atol=1e-5)


def test_cuda_compiled_step_never_synchronises_after_the_first_step():
    """``torch.cuda.set_sync_debug_mode("error")`` turns any host synchronisation into an exception."""
    params = _params("cuda")
    opt = gefen.Gefen(params, lr=1e-2, weight_decay=0.1, fused=True)
    grads = [[g.cuda() for g in _grads(params, s)] for s in range(4)]
    for p, g in zip(params, grads[0]):
        p.grad = g
    opt.step()  # period search, codebook and compilation may synchronise
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for s in range(1, 4):
            for p, g in zip(params, grads[s]):
                p.grad = g
            for group in opt.param_groups:
                group["lr"] *= 0.5  # a scheduler changing the lr must not synchronise either
            opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert all(int(opt.state[p]["step"]) == 4 for p in params)
