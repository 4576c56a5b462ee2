"""The compiled fast path (``fused=True``) against its eager twin (``fused=False``).

Contract (issue 3): identical first-moment codes and magnitudes, second moments and parameters within fp32
rounding (the only differences are the summation order of the block/row/column mean squares and the rounding
of ``sqrt``), the same training trajectory, no recompilation when the lr or the step changes, and failures
to compile either refused before any change (``fused=True``) or answered by the eager path (``fused=None``).
A bad ``GEFEN_FUSED`` environment is refused at construction; the hybrid reports its halves' compile time.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import gefen
import gefen.kernels.backends
import gefen.kernels.compiled
from gefen.errors import ConfigError, StepError
from gefen.kernels.compiled import FUSED_ENV, KernelSignature
from gefen.kernels.fused import lookup_table_as_float, nearest_code_lut
from gefen.math.codebook import nearest_code
from gefen.math.lookup import build_nearest_table
from tests.optim.test_capturable import _cap_grads, _cap_model

pytestmark = pytest.mark.slow  # compiles kernels (seconds each on a cold inductor cache)

#: (shape, planted period) -> the path each one exercises.
SHAPES = [
    ((24, 40), 96),  # factored, blocks straddle rows unevenly: dense denominator
    ((48, 64), 32),  # factored, two blocks per row: row/column factors
    ((6, 10, 8), 80),  # 3-D: block second moment
    ((300,), 60),  # 1-D: block second moment
]


def _grad(shape: tuple[int, ...], period: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """A gradient whose magnitude changes block by block with the given period (the search finds it)."""
    n = torch.Size(shape).numel()
    scale = torch.exp(2 * torch.randn(n // period, 1, generator=gen))
    return (torch.randn(n // period, period, generator=gen) * scale * 1e-3).reshape(shape).to(dtype)


def _train(fused: bool, dtype: torch.dtype = torch.float32, steps: int = 4, **kwargs):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(0)
    params = [
        (f"p{i}", torch.nn.Parameter((torch.randn(shape, generator=gen) * 0.1).to(dtype)))
        for i, (shape, _) in enumerate(SHAPES)
    ]
    opt = gefen.Gefen(params, lr=1e-2, weight_decay=0.1, fused=fused, **kwargs)
    for _ in range(steps):
        for (_, p), (shape, period) in zip(params, SHAPES):
            p.grad = _grad(shape, period, gen, dtype)
        opt.step()
    return opt, [p for _, p in params]


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in fp32 units in the last place between two non-negative fp32 tensors."""
    return int((a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max())


@pytest.fixture
def free_periods(monkeypatch: pytest.MonkeyPatch) -> None:
    """Periods as gefen's earlier free rule chose them (blocks may straddle rows): what a checkpoint saved then
    brings back, which the compiled step's dense-denominator graph serves."""
    monkeypatch.setattr("gefen.optim._first_step.layout_period", lambda period, shape: period)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compiled_step_matches_eager_twin(dtype: torch.dtype, free_periods: None) -> None:
    eager, pe = _train(False, dtype)
    compiled, pc = _train(True, dtype)
    assert len(compiled._kernels) == len(SHAPES) and not compiled._kernels.failures
    kinds = [row["second_moment"] for row in compiled.state_report()]
    assert kinds == ["factored", "factored", "block", "block"]
    periods = [row["period"] for row in compiled.state_report()]
    assert 40 % periods[0] != 0  # blocks straddle rows of (24, 40): the dense-denominator graph ran
    assert 64 % periods[1] == 0 and periods[1] < 64  # several blocks per row of (48, 64): the factor graph ran
    assert torch.equal(eager.codebook, compiled.codebook)
    for a, b in zip(pe, pc):
        se, sc = eager.state[a], compiled.state[b]
        assert torch.equal(se["first_moment_codes"], sc["first_moment_codes"])
        assert torch.equal(se["first_moment_scale"], sc["first_moment_scale"])
        assert int(se["step"]) == int(sc["step"]) == 4
        for key in ("second_moment", "second_moment_row", "second_moment_col"):
            if key in se:
                assert _ulps(se[key], sc[key]) <= 8, key  # summation order of the mean squares
        # parameters: a few fp32 ulps of the update, or one rounding step of a 16-bit parameter
        tolerance = 1e-6 if dtype == torch.float32 else (2.0**-7 if dtype == torch.bfloat16 else 2.0**-10)
        torch.testing.assert_close(b.float(), a.float(), rtol=tolerance, atol=1e-7)


def test_nearest_code_lut_compiled_equals_reference_rule_at_every_threshold() -> None:
    """Every code, every decision threshold and its fp32 neighbours: the compiled search is the §4.8 rule."""
    gen = torch.Generator().manual_seed(3)
    codebook = torch.sort(torch.cat([torch.tensor([-1.0, 0.0, 1.0]), torch.randn(253, generator=gen).tanh()]))[0]
    table = build_nearest_table(codebook)
    inner = table.thresholds[torch.isfinite(table.thresholds)]
    ups = torch.nextafter(inner, torch.tensor(2.0))
    downs = torch.nextafter(inner, torch.tensor(-2.0))
    u = torch.cat([codebook, inner, ups, downs, torch.linspace(-1, 1, 10_001)]).clamp(-1, 1)
    search = torch.compile(nearest_code_lut, fullgraph=True, dynamic=False)
    got = search(u, lookup_table_as_float(table.lut), table.thresholds, table.steps)
    assert torch.equal(got.long(), nearest_code(u, codebook).long())


def test_lr_weight_decay_and_step_changes_do_not_recompile() -> None:
    opt, params = _train(True, steps=1)
    graphs_before = len(opt._kernels)
    compile_time = opt.compile_time_s
    gen = torch.Generator().manual_seed(9)
    for lr, wd in [(3e-3, 0.0), (1e-4, 0.5), (0.0, 0.1)]:
        for group in opt.param_groups:
            group["lr"], group["weight_decay"] = lr, wd
        for p, (shape, period) in zip(params, SHAPES):
            p.grad = _grad(shape, period, gen, torch.float32)
        opt.step()
    assert len(opt._kernels) == graphs_before
    assert opt.compile_time_s == compile_time
    assert int(opt.state[params[0]]["step"]) == 4


def test_lr_zero_and_no_decay_leave_parameters_bit_identical() -> None:
    opt, params = _train(True, steps=1)
    for group in opt.param_groups:
        group["lr"], group["weight_decay"] = 0.0, 0.0
    before = [p.detach().clone() for p in params]
    gen = torch.Generator().manual_seed(1)
    for p, (shape, period) in zip(params, SHAPES):
        p.grad = _grad(shape, period, gen, torch.float32)
    opt.step()
    for a, b in zip(before, params):
        assert torch.equal(a, b)


def test_more_signatures_than_the_dynamo_recompile_limit() -> None:
    """Each signature owns its code object, so a model with many shapes never falls back to eager graphs."""
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        opt, params = _train(True, steps=2)
    assert len(opt._kernels) == len(SHAPES) and not opt._kernels.failures
    eager, pe = _train(False, steps=2)
    for a, b in zip(pe, params):
        assert torch.equal(eager.state[a]["first_moment_codes"], opt.state[b]["first_moment_codes"])


def test_non_contiguous_gradient_uses_the_compiled_kernel() -> None:
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(48, 64, generator=gen))
    q = torch.nn.Parameter(p.detach().clone())
    opt_c = gefen.Gefen([p], lr=1e-2, fused=True)
    opt_e = gefen.Gefen([q], lr=1e-2, fused=False)
    for _ in range(2):
        g = _grad((64, 48), 32, gen, torch.float32).t()  # (48, 64), column-major
        assert not g.is_contiguous()
        p.grad, q.grad = g, g.contiguous()
        opt_c.step()
        opt_e.step()
    assert len(opt_c._kernels) == 1
    assert torch.equal(opt_c.state[p]["first_moment_codes"], opt_e.state[q]["first_moment_codes"])
    torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def _failing_compile(*args: object, **kwargs: object):  # type: ignore[no-untyped-def]
    def fail(*a: object, **k: object) -> None:
        raise RuntimeError("no C++ compiler (simulated)")

    return fail


def test_fused_true_compile_failure_refuses_the_step_and_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gefen.kernels.compiled.torch, "compile", _failing_compile)
    p = torch.nn.Parameter(torch.randn(4, 16))
    before = p.detach().clone()
    opt = gefen.Gefen([p], lr=1e-2, fused=True)
    p.grad = torch.randn(4, 16)
    with warnings.catch_warnings():
        # 64 elements fill < 255 histogram bins: a kept codebook would warn, a discarded one must not
        warnings.simplefilter("error")
        with pytest.raises(StepError, match="fused=True.*no C\\+\\+ compiler.*Nothing was changed"):
            opt.step()
    assert torch.equal(p, before)
    assert opt.codebook is None and opt.global_step == 0 and len(opt.state) == 0


def test_fused_none_compile_failure_warns_once_and_runs_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """``backend="auto"`` chooses the compiled step on CUDA; a compile failure there warns once and runs eagerly.
    (On the CPU auto chooses the native backend, so the CUDA choice is simulated here.)"""
    monkeypatch.setattr(gefen.kernels.compiled.torch, "compile", _failing_compile)
    monkeypatch.setitem(gefen.kernels.backends.AUTO_ORDER, "cpu", ("compiled",))
    monkeypatch.setenv(FUSED_ENV, "1")
    p = torch.nn.Parameter(torch.randn(48, 64))
    q = torch.nn.Parameter(p.detach().clone())
    opt = gefen.Gefen([p], lr=1e-2)
    twin = gefen.Gefen([q], lr=1e-2, fused=False)
    with pytest.warns(UserWarning, match="using the eager step") as record:
        for _ in range(2):
            p.grad = torch.randn(48, 64, generator=torch.Generator().manual_seed(len(record)))
            q.grad = p.grad.clone()
            opt.step()
            twin.step()
    assert sum("eager step" in str(w.message) for w in record) == 1
    assert opt.compile_time_s >= 0.0 and len(opt._kernels) == 0
    assert torch.equal(p, q)


def test_fused_option_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TypeError, match="fused"):
        gefen.Gefen([torch.nn.Parameter(torch.randn(4))], fused="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="float64"):
        gefen.Gefen([torch.nn.Parameter(torch.randn(4, dtype=torch.float64))], fused=True)
    with pytest.raises(ConfigError, match="fused"):
        gefen.Gefen([{"params": [torch.nn.Parameter(torch.randn(4))], "fused": 1}])
    # float64 parameters are fine with the default: they take the eager path
    p = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.float64))
    opt = gefen.Gefen([p])
    p.grad = torch.randn(8, 8, dtype=torch.float64)
    opt.step()
    assert len(opt._kernels) == 0 and p.dtype == torch.float64
    monkeypatch.setenv(FUSED_ENV, "maybe")
    p.grad = torch.randn(8, 8, dtype=torch.float64)
    with pytest.raises(ConfigError, match=FUSED_ENV):
        opt.step()


def test_fused_true_with_dynamo_disabled_is_refused() -> None:
    p = torch.nn.Parameter(torch.randn(8, 8))
    opt = gefen.Gefen([p], fused=True)
    p.grad = torch.randn(8, 8)
    with torch._dynamo.config.patch(disable=True), pytest.raises(StepError, match="disabled"):
        opt.step()
    assert opt.codebook is None


def test_signature_eligibility() -> None:
    base = dict(kind="block", shape=(4, 8), period=8, device_type="cpu", steps=1, lerp_high=False)
    assert KernelSignature(param_dtype=torch.float32, grad_dtype=torch.float32, **base).eligible()
    assert KernelSignature(param_dtype=torch.bfloat16, grad_dtype=torch.float16, **base).eligible()
    assert not KernelSignature(param_dtype=torch.float64, grad_dtype=torch.float64, **base).eligible()
    assert not KernelSignature(param_dtype=torch.float32, grad_dtype=torch.float64, **base).eligible()


def test_high_lerp_weight_branch_matches_eager() -> None:
    """``1 − β1 >= 0.5`` takes torch's other lerp formula; codes must still agree bit for bit."""
    eager, pe = _train(False, betas=(0.3, 0.999), steps=3)
    compiled, pc = _train(True, betas=(0.3, 0.999), steps=3)
    assert all(sig.lerp_high for sig in compiled._kernels._kernels)
    for a, b in zip(pe, pc):
        assert torch.equal(eager.state[a]["first_moment_codes"], compiled.state[b]["first_moment_codes"])
        assert torch.equal(eager.state[a]["first_moment_scale"], compiled.state[b]["first_moment_scale"])


def test_demo_model_trajectory_matches_eager_for_50_steps() -> None:
    """The demo's byte transformer trained 50 steps with each path stays within fp32 rounding drift.

    "Within fp32 rounding" is measured, not assumed: the envelope is the loss drift of the eager path itself
    when every initial weight is moved by one fp32 ulp (up, and down). Training is chaotic, so one such sample
    is itself noisy (measured 0.0236 and drift 0.0238 on one CPU, drift 0.005 on another): the bound is 1.5× the
    larger sample; a real defect drifts by tenths of a nat.
    """
    from gefen.cli._data import BatchSampler, load_corpus
    from gefen.cli._model import build_model
    from gefen.cli._optimizers import param_groups

    corpus = load_corpus()

    def curve(fused: bool, nudge: float = 0.0) -> torch.Tensor:
        model = build_model("tiny", context_len=64, seed=0)
        if nudge:
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(torch.nextafter(p, torch.full_like(p, nudge)))
        opt = gefen.Gefen(param_groups(model), lr=1e-3, betas=(0.9, 0.95), fused=fused)
        sampler = BatchSampler(corpus.train, batch_size=8, seq_len=64, seed=0)
        losses = []
        for _ in range(50):
            loss = model.loss(sampler.next())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        if fused:
            assert len(opt._kernels) > 0 and not opt._kernels.failures
        return torch.tensor(losses)

    eager, compiled = curve(False), curve(True)
    assert compiled[0] == eager[0]  # same model, same batch, nothing stepped yet
    drift = (compiled - eager).abs().max().item()
    envelope = max((curve(False, nudge=n) - eager).abs().max().item() for n in (10.0, -10.0))
    assert drift <= 1.5 * max(envelope, 1e-3), (drift, envelope)
    assert compiled[-1] < compiled[0] - 2.0  # and it trains (5.6 -> ~2.8 nats)


def test_kernel_failure_inside_step_completes_the_step_eagerly_then_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """A recompilation can fail inside step(): the step is still applied whole (eager for the rest), counters stay
    consistent, and with fused=True the next step is refused before any change."""
    opt, params = _train(True, steps=1)
    eager, twins = _train(False, steps=1)
    calls = []

    def flaky(kernel):  # type: ignore[no-untyped-def]
        def call(*args):  # type: ignore[no-untyped-def]
            calls.append(kernel)
            if len(calls) == 2:  # the second compiled kernel of the step fails, as a failed recompile would
                raise RuntimeError("recompilation failed (simulated)")
            kernel(*args)

        return call

    for signature, kernel in list(opt._kernels._kernels.items()):
        monkeypatch.setitem(opt._kernels._kernels, signature, flaky(kernel))
    gen = torch.Generator().manual_seed(5)
    grads = [_grad(shape, period, gen, torch.float32) for shape, period in SHAPES]
    for p, q, g in zip(params, twins, grads):
        p.grad, q.grad = g.clone(), g.clone()
    with pytest.warns(UserWarning, match="failed inside step.*completed on the eager path"):
        opt.step()
    eager.step()
    assert [int(opt.state[p]["step"]) for p in params] == [2, 2, 2, 2]
    for p, q in zip(params, twins):
        assert torch.equal(opt.state[p]["first_moment_codes"], eager.state[q]["first_moment_codes"])
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    before = [p.detach().clone() for p in params]
    with pytest.raises(StepError, match="fused=True.*recompilation failed"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, params))
    assert [int(opt.state[p]["step"]) for p in params] == [2, 2, 2, 2]


def test_thread_count_change_recompiles_and_stays_correct() -> None:
    threads = torch.get_num_threads()
    try:
        opt, params = _train(True, steps=1)
        eager, twins = _train(False, steps=1)
        gen = torch.Generator().manual_seed(6)
        for count in (1, threads):
            torch.set_num_threads(count)  # a guard on global state: dynamo re-specialises the graphs
            grads = [_grad(shape, period, gen, torch.float32) for shape, period in SHAPES]
            for p, q, g in zip(params, twins, grads):
                p.grad, q.grad = g.clone(), g.clone()
            opt.step()
            eager.step()
    finally:
        torch.set_num_threads(threads)
    assert not opt._kernels.failures
    for p, q in zip(params, twins):
        assert int(opt.state[p]["step"]) == 3
        assert torch.equal(opt.state[p]["first_moment_codes"], eager.state[q]["first_moment_codes"])


def test_non_contiguous_parameter_and_float64_gradient_run_compiled() -> None:
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(64, 48, generator=gen)
    p = base.clone().t().requires_grad_()  # (48, 64), column-major
    q = torch.nn.Parameter(base.clone().t().contiguous())
    assert not p.is_contiguous()
    p.grad_dtype = q.grad_dtype = None  # allow float64 gradients on float32 parameters (torch >= 2.9 checks)
    opt, twin = gefen.Gefen([p], lr=1e-2, fused=True), gefen.Gefen([q], lr=1e-2, fused=False)
    for _ in range(2):
        g = _grad((48, 64), 32, gen, torch.float64)
        p.grad, q.grad = g, g.clone()
        opt.step()
        twin.step()
    assert len(opt._kernels) == 1 and opt.compile_time_s > 0
    assert not p.is_contiguous()  # updated in place, layout kept
    assert torch.equal(opt.state[p]["first_moment_codes"], twin.state[q]["first_moment_codes"])
    torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)


def test_fused_true_group_with_a_float64_parameter_is_refused_at_step() -> None:
    p = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.float64))
    opt = gefen.Gefen([p], fused=None)
    opt.param_groups[0]["fused"] = True  # set by hand after construction
    p.grad = torch.randn(8, 8, dtype=torch.float64)
    before = p.detach().clone()
    with pytest.raises(StepError, match="fused=True.*float64.*Nothing was changed"):
        opt.step()
    assert torch.equal(p, before) and opt.codebook is None


def test_load_state_dict_keeps_the_live_fused_setting() -> None:
    eager, params = _train(False, steps=2)
    saved = eager.state_dict()
    assert saved["param_groups"][0]["fused"] is False
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = gefen.Gefen(copies, lr=1e-2, weight_decay=0.1, fused=True)
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["fused"] is True
    old = dict(saved, param_groups=[{k: v for k, v in g.items() if k != "fused"} for g in saved["param_groups"]])
    resumed.load_state_dict(old)  # checkpoints written before the option existed
    assert resumed.param_groups[0]["fused"] is True


def test_gefen_muon_compiled_momentum_matches_eager() -> None:
    """GefenMuon's quantized momentum through the shared compiled machinery: same codes, same parameters."""
    gen = torch.Generator().manual_seed(0)
    shapes = [((24, 40), 96), ((48, 64), 32)]
    runs = {}
    for fused in (False, True):
        params = [
            torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(i)))
            for i, (shape, _) in enumerate(shapes)
        ]
        opt = gefen.GefenMuon(params, lr=0.02, normuon=True, fused=fused)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            for p, (shape, period) in zip(params, shapes):
                p.grad = _grad(shape, period, gen, torch.float32)
            opt.step()
        runs[fused] = (opt, params)
    (eager, pe), (compiled, pc) = runs[False], runs[True]
    assert len(compiled._kernels) == 2 and all(sig.kind == "momentum" for sig in compiled._kernels._kernels)
    for a, b in zip(pe, pc):
        assert torch.equal(eager.state[a]["first_moment_codes"], compiled.state[b]["first_moment_codes"])
        assert torch.equal(eager.state[a]["first_moment_scale"], compiled.state[b]["first_moment_scale"])
        assert int(compiled.state[b]["step"]) == 3
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_real_steps_reuse_the_graphs_compiled_before_the_step() -> None:
    """The scratch compilation and the real calls must agree on every guard: no graph is compiled twice."""
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    opt, params = _train(True, steps=3)  # 2 factored (2 graphs each) + 2 block (1 each)
    muon_params = [torch.nn.Parameter(torch.randn(16, 24)), torch.nn.Parameter(torch.randn(30, 12))]
    muon = gefen.GefenMuon(muon_params, lr=0.02, fused=True)
    for _ in range(3):
        for p in muon_params:
            p.grad = torch.randn_like(p)
        muon.step()
    assert len(opt._kernels) == 4 and len(muon._kernels) == 2
    assert counters["stats"]["unique_graphs"] - before == 2 * 2 + 2 + 2


def test_bad_gefen_fused_environment_is_refused_at_construction(monkeypatch):
    monkeypatch.setenv("GEFEN_FUSED", "maybe")
    with pytest.raises(gefen.ConfigError, match="GEFEN_FUSED='maybe'"):
        gefen.Gefen(_cap_model().named_parameters())
    with pytest.raises(gefen.ConfigError, match="GEFEN_FUSED='maybe'"):
        gefen.GefenMuonHybrid(_cap_model(), lr=1e-2)
    gefen.Gefen(_cap_model().named_parameters(), fused=False)  # an explicit choice does not read it


@pytest.mark.slow
def test_hybrid_reports_its_children_compile_time():
    m = _cap_model()
    h = gefen.GefenMuonHybrid(m, lr=1e-2, fused=True)
    assert h.compile_time_s == 0.0
    _cap_grads(m, 0)
    h.step()
    assert h.compile_time_s == h.muon.compile_time_s + h.backup.compile_time_s > 0.0


@pytest.mark.parametrize("kind", ["block", "factored"])
def test_kernels_with_apply_zero_write_nothing_even_for_a_nan_gradient(kind: str) -> None:
    """Entry ``APPLY`` of the scalars (the device-side ``nonfinite="skip"`` decision): 0 keeps the parameter and
    every state tensor bit for bit, whatever the gradient holds; 1 writes the step as before (the same values as
    without the entry's masking, i.e. the eager reference within the existing tolerance, checked above)."""
    from gefen.kernels.fused import factored_roots_, fused_block_step_, fused_factored_update_
    from gefen.kernels.scalars import APPLY, COMPILED_LAYOUT, StepScalars

    gen = torch.Generator().manual_seed(3)
    table = build_nearest_table(torch.linspace(-1, 1, 256))
    tables = (table.codebook, lookup_table_as_float(table.lut), table.thresholds)
    rows, cols, period = 8, 32, 16
    param = torch.randn(rows * cols // period, period, generator=gen)
    grad = torch.randn(rows * cols // period, period, generator=gen)
    grad[1, 3] = float("nan")
    codes = torch.randint(0, 256, param.shape, generator=gen, dtype=torch.uint8)
    scale = torch.rand(param.shape[0], generator=gen)
    second = [torch.rand(param.shape[0], generator=gen)] if kind == "block" else [torch.rand(rows), torch.rand(cols)]
    for apply in (0.0, 1.0):
        scalars = torch.tensor(StepScalars(0.9, 0.999, 1e-8, 1e-2, 0.1).compiled_row(3, kind == "factored"))
        assert scalars.numel() == len(COMPILED_LAYOUT) and scalars[APPLY] == 1.0
        scalars[APPLY] = apply
        state = [t.clone() for t in (param, codes, scale, *second)]
        p, c, s, *v = state
        if kind == "block":
            fused_block_step_(p, grad, c, s, v[0], *tables, scalars, steps=table.steps, lerp_high=False)
        else:
            roots = factored_roots_(grad.view(rows, cols), v[0], v[1], scalars, dense=False)
            fused_factored_update_(p, grad, c, s, roots, *tables, scalars, steps=table.steps, lerp_high=False)
        unchanged = [torch.equal(a, b) for a, b in zip(state, (param, codes, scale, *second))]
        if apply == 0.0:
            assert all(unchanged)
        else:  # the NaN reaches the written state: the flag is what kept it out above
            assert not all(unchanged) and torch.isnan(p).any()
