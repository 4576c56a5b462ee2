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
    """``torch.cuda.set_sync_debug_mode("error")`` turns any host synchronisation into an exception.

    ``nonfinite="propagate"`` here; the default ``"skip"`` is tested below (it decides on the device too)."""
    params = _params("cuda")
    opt = gefen.Gefen(params, lr=1e-2, weight_decay=0.1, fused=True, nonfinite="propagate")
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


def test_cuda_default_nonfinite_skip_decides_on_the_device_and_settles_when_the_host_looks():
    """The default policy on the compiled CUDA step makes no host synchronisation (sync debug mode "error" stays
    quiet over steady steps, a NaN step included): the flags mask the kernels' writes on the device, and the host
    learns of the skip when it next looks (``skipped_steps``), with nothing changed; the next step is the clean one."""
    params = _params("cuda")
    clean_params = [p.detach().clone().requires_grad_() for p in params]
    opt, clean = gefen.Gefen(params, lr=1e-2, fused=True), gefen.Gefen(clean_params, lr=1e-2, fused=True)
    for s in range(2):
        for ps, o in ((params, opt), (clean_params, clean)):
            for p, g in zip(ps, _grads(params, s)):
                p.grad = g.cuda()
            o.step()
    torch.cuda.synchronize()
    before = [p.detach().clone() for p in params]
    params[0].grad[0] = float("nan")
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()  # no host read: it would raise here
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with pytest.warns(UserWarning, match="skipped this step"):
        assert opt.skipped_steps == 1
    assert opt.global_step == 2
    assert all(torch.equal(a, b) for a, b in zip(before, params))
    for ps, o in ((params, opt), (clean_params, clean)):
        for p, g in zip(ps, _grads(params, 5)):
            p.grad = g.cuda()
        o.step()
    assert opt.global_step == clean.global_step == 3
    assert all(torch.equal(a, b) for a, b in zip(params, clean_params))


def _cuda_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 128), torch.nn.Linear(128, 64)).cuda()


def _cuda_grads(model, step):
    tokens = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(step)).cuda()
    model.zero_grad(set_to_none=False)
    model(tokens).square().mean().backward()


def _capture_step(opt):
    """One ``opt.step()`` captured in a CUDA graph on a side stream (torch's recipe); returns the graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            opt.step()
    torch.cuda.current_stream().wait_stream(stream)
    return graph


@pytest.mark.parametrize("kind", ["gefen", "hybrid"])
def test_cuda_graph_capture_of_a_capturable_step_replays_and_counts_steps(kind):
    """Warm up 2 eager steps, capture one ``step()`` in a CUDA graph, replay it 3 times with new gradients and a
    new lr written in place: the parameters follow an eager capturable twin, and the global step is 5 (capturing
    records the step without running it; the device counter is the checkpoint authority, hardening.md §3.3)."""

    def build(model):
        lr = torch.tensor(1e-2, device="cuda")
        if kind == "gefen":
            return gefen.Gefen(model.named_parameters(), lr=lr, capturable=True), [lr]
        opt = gefen.GefenMuonHybrid(model, lr=lr, backup_lr=lr.clone(), capturable=True)
        return opt, [g["lr"] for g in opt.param_groups]

    model, twin = _cuda_model(), _cuda_model()
    opt, lrs = build(model)
    twin_opt, twin_lrs = build(twin)
    for s in range(2):
        _cuda_grads(model, s)
        opt.step()
        _cuda_grads(twin, s)
        twin_opt.step()
    graph = _capture_step(opt)
    children = [opt.muon, opt.backup] if kind == "hybrid" else [opt]
    for s in range(2, 5):
        _cuda_grads(model, s)  # same gradient buffers (zero_grad(set_to_none=False))
        for lr in lrs + twin_lrs:
            lr.fill_(1e-2 * 0.7 ** (s - 1))
        graph.replay()
        _cuda_grads(twin, s)
        twin_opt.step()
    torch.cuda.synchronize()
    # bf16 Newton–Schulz in the Muon half may round differently in the captured stream; Gefen agrees to fp32 rounding
    for a, b in zip(model.parameters(), twin.parameters()):
        assert float((a - b).norm()) <= 1e-3 * float(b.norm()) + 1e-6
    assert all(c.global_step == 5 for c in children)  # 2 eager + 3 replays (the capture itself runs nothing)
    assert all(c.state_dict()["gefen"]["global_step"] == 5 for c in children)
    assert all(int(c.state[p]["step"]) == 5 for c in children for g in c.param_groups for p in g["params"])


def test_cuda_capture_of_a_non_capturable_step_is_refused():
    model = _cuda_model()
    opt = gefen.Gefen(model.named_parameters(), lr=1e-2)
    _cuda_grads(model, 0)
    opt.step()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), pytest.raises(gefen.StepError, match="capturable=False"):
        with torch.cuda.graph(graph):
            opt.step()


def test_cuda_fp16_gradscaler_overflow_changes_nothing():
    torch.manual_seed(0)
    model = _cuda_model().half()
    opt = gefen.Gefen(model.named_parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10)
    tokens = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0)).cuda()
    scaler.scale(model(tokens).float().square().mean()).backward()
    model[1].weight.grad[0, 0] = float("inf")
    params = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    assert opt.codebook is None and opt.global_step == 0 and len(opt.state) == 0
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert scaler.get_scale() == 2.0**9


@pytest.mark.parametrize("fused", [False, True])
def test_cuda_deterministic_runs_are_bit_identical(fused):
    def run():
        model = _cuda_model()
        opt = gefen.Gefen(model.named_parameters(), lr=1e-2, deterministic=True, fused=fused)
        for s in range(3):
            _cuda_grads(model, s)
            opt.step()
        return [p.detach().clone() for p in model.parameters()], opt.state_dict()

    (p1, s1), (p2, s2) = run(), run()
    assert all(torch.equal(a, b) for a, b in zip(p1, p2))
    for k, st in s1["state"].items():
        for key, v in st.items():
            assert torch.equal(v, s2["state"][k][key]), key


def test_cuda_capturable_lr_on_the_cpu_is_refused():
    model = _cuda_model()
    opt = gefen.Gefen(model.named_parameters(), lr=torch.tensor(1e-2), capturable=True)
    _cuda_grads(model, 0)
    with pytest.raises(gefen.ConfigError, match="lr'\\] is on cpu"):
        opt.step()
    assert opt.codebook is None and len(opt.state) == 0


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_triton_step_matches_the_cpu_native_step(dtype):
    """The Triton kernels on the GPU against the native library on the CPU: codes and magnitudes bit-identical,
    second moments within 4 ulp, parameters within 2 ulp plus 1e-5 of the update (GPU div/sqrt numerics, FTZ and
    the fp64 power are what the CPU interpreter tests cannot show)."""
    assert _triton_available(), "triton is part of torch's CUDA wheels"
    cpu, cuda = _params("cpu", dtype), _params("cuda", dtype)
    start = [p.detach().float().clone() for p in cpu]
    opt_cpu = gefen.Gefen(cpu, lr=1e-2, weight_decay=0.1, backend="native")
    opt_cuda = gefen.Gefen(cuda, lr=1e-2, weight_decay=0.1, backend="triton")
    for s in range(4):
        grads = [g.to(dtype) for g in _grads(cpu, s)]
        grads[0][0, :7] = 0.0  # a zero run, and denormal / threshold-sized values below
        grads[1][1, :4] = torch.tensor([1e-40, -1e-39, 2.0**-126, -(2.0**-127)]).to(dtype)
        for p_cpu, p_cuda, g in zip(cpu, cuda, grads):
            p_cpu.grad, p_cuda.grad = g.clone(), g.cuda()
        opt_cpu.step()
        opt_cuda.step()
    for p_cpu, p_cuda, p0 in zip(cpu, cuda, start):
        a, b = opt_cpu.state[p_cpu], opt_cuda.state[p_cuda]
        assert torch.equal(a[FIRST_MOMENT_CODES], b[FIRST_MOMENT_CODES].cpu())
        assert torch.equal(a["first_moment_scale"], b["first_moment_scale"].cpu())
        for key in ("second_moment", "second_moment_row", "second_moment_col"):
            if key in a:
                torch.testing.assert_close(b[key].cpu(), a[key], rtol=4 * 2**-23, atol=0)
        x, y = p_cpu.detach().float(), p_cuda.detach().float().cpu()
        bound = 2 * torch.finfo(dtype).eps * x.abs() + 1e-5 * (x - p0).abs()
        assert bool(((x - y).abs() <= bound).all())


def test_cuda_triton_steady_skip_step_does_not_synchronise_and_nan_changes_nothing():
    """Under the default ``nonfinite="skip"`` a steady Triton step decides on the device: no host sync while it
    runs (``set_sync_debug_mode("error")``); a NaN step then changes nothing and is counted when the host looks."""
    params = _params("cuda")
    opt = gefen.Gefen(params, lr=1e-2, weight_decay=0.1, backend="triton")
    grads = [[g.cuda() for g in _grads(params, s)] for s in range(4)]
    for p, g in zip(params, grads[0]):
        p.grad = g
    opt.step()
    for p, g in zip(params, grads[1]):
        p.grad.copy_(g)
    opt.step()  # the plan is built
    torch.cuda.synchronize()
    before = [p.detach().clone() for p in params]
    grads[2][1][5, 5] = float("nan")
    for p, g in zip(params, grads[2]):
        p.grad.copy_(g)
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with pytest.warns(UserWarning, match="NaN|Inf|skip"):
        assert opt.skipped_steps == 1
    assert all(torch.equal(a, p) for a, p in zip(before, params))
    assert all(int(opt.state[p]["step"]) == 2 for p in params)


def test_cuda_triton_backend_benchmark_row_runs():
    """benchmarks/step.py's gefen_triton factory: the 25m set steps on the Triton backend (its ratio is in JSON)."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).cuda()
    opt = gefen.Gefen(model.named_parameters(), lr=1e-3, backend="triton")
    for _ in range(3):
        model(torch.randn(32, 256, device="cuda")).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert opt.global_step == 3 and opt.state_bytes() / sum(p.numel() for p in model.parameters()) < 1.1


def test_cuda_triton_self_check_passes_and_auto_takes_triton():
    """The device self-check (gefen.kernels.triton_check) passes on this GPU, so ``backend="auto"`` steps on Triton."""
    from gefen.kernels import triton_check
    from gefen.kernels.backends import Backends

    assert triton_check.self_check(torch.device("cuda")) == ""
    p = torch.nn.Parameter(torch.randn(64, 48, device="cuda"))
    assert Backends().choose("auto", p, torch.float32, False) == ("triton", "")


def test_cuda_multi_tensor_usable_check_equals_the_per_gradient_one():
    """The CUDA form of the gradient check (foreach reductions; NaN caught whether or not the max propagates it)."""
    from gefen.amp import _usable, usable_bound, usable_flags

    grads = []
    for numel in (1, 1000):
        bound = torch.tensor(usable_bound(numel), dtype=torch.float32)
        for value in (bound, torch.nextafter(bound, torch.tensor(float("inf")))):
            g = torch.zeros(numel)
            g[numel // 2] = value
            grads.append(g)
    for bad in (float("nan"), float("inf")):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            g = torch.randn(4096).to(dtype)
            g[4000] = bad
            grads.append(g)
    grads += [torch.full((5,), 6.0e4, dtype=torch.float16), torch.randn(7, dtype=torch.float64)]
    expected = [bool(_usable(g)) for g in grads]
    assert usable_flags([g.cuda() for g in grads]).cpu().tolist() == expected


def test_cuda_graph_capture_of_a_triton_skip_step_replays_and_skips_on_the_device():
    """``capturable=True, nonfinite="skip"`` on Triton: a captured step replays with new gradients written in place;
    a replay with a NaN gradient changes nothing and is counted on the device, reported when the host looks; the
    parameters follow an eager twin that never saw the NaN replay."""
    model, twin = _cuda_model(), _cuda_model()
    opt = gefen.Gefen(model.named_parameters(), lr=1e-2, capturable=True, nonfinite="skip", backend="triton")
    twin_opt = gefen.Gefen(twin.named_parameters(), lr=1e-2, capturable=True, nonfinite="skip", backend="triton")
    for s in range(2):
        for m, o in ((model, opt), (twin, twin_opt)):
            _cuda_grads(m, s)
            o.step()
    graph = _capture_step(opt)
    for s in range(2, 6):
        _cuda_grads(model, s)
        if s == 3:
            before = [p.detach().clone() for p in model.parameters()]
            next(model.parameters()).grad[0, 0] = float("nan")
            graph.replay()
            torch.cuda.synchronize()
            assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
            continue
        graph.replay()
        _cuda_grads(twin, s)
        twin_opt.step()
    torch.cuda.synchronize()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    with pytest.warns(UserWarning, match=r"1 step\(s\) were skipped on the device"):
        assert opt.skipped_steps == 1
    assert opt.global_step == 5 == twin_opt.global_step


def test_cuda_first_step_synchronises_a_fixed_number_of_times():
    """The first step on the GPU (period search, histogram, codebook, the Triton plan): its host synchronisations,
    counted by ``set_sync_debug_mode("warn")``, do not grow with the number of parameters."""
    import warnings

    def syncs(layers):
        gen = torch.Generator().manual_seed(layers)
        params = []
        for _ in range(layers):
            params += [torch.nn.Parameter(torch.randn(96, 128, generator=gen).cuda()),
                       torch.nn.Parameter(torch.randn(96, generator=gen).cuda())]  # fmt: skip
        for p in params:
            p.grad = torch.randn_like(p)
        opt = gefen.Gefen(params, lr=1e-2)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in caught)

    few, many = syncs(2), syncs(16)
    assert many == few and few <= 16, (few, many)


def test_cuda_capacity_run_is_capped_by_the_budget_and_reports_out_of_memory():
    """``gefen capacity`` on CUDA: a small model trains under its budget (peak = ``max_memory_allocated``), and a
    model whose fp32 weights alone pass the budget comes back as ``oom`` from the capped allocator."""
    from gefen.cli._capacity_probe import ProbeSpec, run_probe
    from gefen.cli._capacity_search import model_family

    family = model_family()
    small = family[60]
    spec = ProbeSpec("gefen", small.d_model, small.n_layers, small.d_ff, 2**30, "cuda", autocast="bf16")
    fit = run_probe(spec, small)
    assert fit.status == "fit", fit.detail
    assert 4 * small.params < fit.peak_bytes <= 2**30 and fit.extra["max_memory_reserved"] >= fit.peak_bytes
    big = next(m for m in family if 4 * m.params > 2**30)
    oom = run_probe(ProbeSpec("adamw", big.d_model, big.n_layers, big.d_ff, 2**30, "cuda", autocast="bf16"), big)
    assert oom.status == "oom" and "out of memory" in oom.detail and oom.fits(2**30) is False
