"""Every registered step backend against the eager reference (issue 13).

The contract (``gefen.kernels``): first-moment codes and magnitudes bit-identical to the eager reference; second
moments equal up to the summation order of their sums. The bound the tests hold is 16 fp32 ulps: a sum of ``n``
non-negative fp32 terms in two orders differs by up to about ``n`` half-ulps in the worst case and by about
``sqrt(n)`` typically; the native kernel sums a block in 16 lanes (the reference in torch's own order), which gave
at most 5 ulps over every case here, and it sums factored rows/columns in fp64 (correctly rounded means, at most 2
ulps from the reference). Parameters are equal up to what those ulps do to one update: at most 1e-6 of the step's
update plus one ulp of the parameter's dtype (a bf16/fp16 result can sit on either side of a rounding boundary).
GefenMuon's momentum has no sum at all: its codes, magnitudes and parameters are bit-identical.

Every case is run on every CPU path this machine has (``avx512vbmi``, ``avx512``, ``avx2``, ``scalar``), so one
machine checks the scalar fallback that other CPUs take.
"""

from __future__ import annotations

import copy

import pytest
import torch

import gefen
from gefen.kernels import native
from gefen.kernels.scalars import StepScalars
from gefen.state import ParamState

pytestmark = pytest.mark.skipif(
    not native.native_status().available, reason=f"native library unavailable: {native.native_status().reason}"
)

LEVEL_ORDER = ["scalar", "avx2", "avx512", "avx512vbmi"]


def _levels() -> list[str]:
    status = native.native_status()
    if not status.available:
        return ["scalar"]
    return LEVEL_ORDER[: LEVEL_ORDER.index(status.level) + 1]


LEVELS = _levels()
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

#: (shape, planted period or None for random gradients, what it exercises)
CASES = [
    ((96, 130), 130, "factored, one block per row"),
    ((64, 96), 48, "factored, two blocks per row"),
    ((40, 48), 1920, "factored, a block spans many rows"),
    ((7, 13), None, "prime dimensions (block, period from the fallback)"),
    ((1,), None, "one element, period 1"),
    ((7,), None, "7 elements, period 1: seven one-element blocks"),
    ((3, 5, 70), 70, "3-D, block second moment"),
    ((1000,), 8, "1-D, many short blocks"),
]


@pytest.fixture(autouse=True)
def _restore_level():
    yield
    native.force_level(None)


def _grad(shape: tuple[int, ...], period: int | None, gen: torch.Generator) -> torch.Tensor:
    n = torch.Size(shape).numel()
    if period is None:
        return torch.randn(shape, generator=gen) * 1e-3
    scale = torch.exp(2 * torch.randn(n // period, 1, generator=gen))
    return (torch.randn(n // period, period, generator=gen) * scale * 1e-3).reshape(shape)


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of each element of ``x`` in its own dtype, as fp32."""
    return (
        torch.nextafter(x.float().abs().to(x.dtype), torch.tensor(float("inf"), dtype=x.dtype)).float()
        - x.float().abs()
    )


def _second(view: ParamState) -> list[torch.Tensor]:
    if view.kind == "factored":
        return [view.second_moment_row, view.second_moment_col]
    return [view.second_moment] if view.second_moment is not None else []


def _fp32_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max()) if a.numel() else 0


def _sync(dst: gefen.Gefen, src: gefen.Gefen, dst_params: list[torch.Tensor], src_params: list[torch.Tensor]) -> None:
    """Make ``dst``'s parameters and state equal to ``src``'s (so each step is compared from equal inputs)."""
    with torch.no_grad():
        for p, q in zip(dst_params, src_params):
            p.copy_(q)
            a, b = dst.state[p], src.state[q]
            for key, value in b.items():
                if isinstance(value, torch.Tensor):
                    a[key].copy_(value)


def _compare_steps(backend: str, shape, period, pdt, gdt, factored: bool, noncontiguous: bool = False) -> None:
    gen = torch.Generator().manual_seed(1)
    init = (torch.randn(shape, generator=gen) * 0.1).to(pdt)
    ref_p, test_p = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    kwargs = {"lr": 1e-2, "weight_decay": 0.1, "factored_v_2d": factored}
    ref = gefen.Gefen([ref_p], backend="eager", **kwargs)
    test = gefen.Gefen([test_p], backend=backend, **kwargs)
    for step in range(3):
        g = _grad(shape, period, gen).to(gdt)
        if noncontiguous and len(shape) == 2:
            g = g.t().contiguous().t()  # same values, column-major strides
            assert not g.is_contiguous()
        before = ref_p.detach().float().clone()
        ref_p.grad, test_p.grad = g.clone(), g
        ref.step()
        test.step()
        r, t = ParamState.from_dict(ref.state[ref_p]), ParamState.from_dict(test.state[test_p])
        assert r.period == t.period and r.kind == t.kind
        assert torch.equal(r.codes, t.codes), f"step {step}: codes differ"
        assert torch.equal(r.scale, t.scale), f"step {step}: magnitudes differ"
        for a, b in zip(_second(r), _second(t)):
            assert _fp32_ulps(a, b) <= 16, f"step {step}: second moment differs by {_fp32_ulps(a, b)} ulps"
        update = (ref_p.detach().float() - before).abs().max()
        bound = 1e-6 * update + _ulp(ref_p.detach()).max()
        diff = (ref_p.detach().float() - test_p.detach().float()).abs().max()
        assert diff <= bound, f"step {step}: parameters differ by {diff} > {bound}"
        _sync(test, ref, [test_p], [ref_p])


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize(("shape", "period", "what"), CASES, ids=[c[2] for c in CASES])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_native_matches_eager(level: str, shape, period, what: str, dtype: str) -> None:
    native.force_level(level)
    factored = len(shape) == 2
    _compare_steps("native", shape, period, DTYPES[dtype], DTYPES[dtype], factored)


@pytest.mark.parametrize("level", LEVELS)
def test_native_block_kind_of_a_2d_weight(level: str) -> None:
    native.force_level(level)
    _compare_steps("native", (64, 96), 48, torch.float32, torch.float32, factored=False)
    _compare_steps("native", (64, 96), 48, torch.float16, torch.float16, factored=False)


@pytest.mark.parametrize("level", LEVELS)
def test_native_non_contiguous_gradient(level: str) -> None:
    native.force_level(level)
    _compare_steps("native", (64, 96), 48, torch.float32, torch.float32, factored=True, noncontiguous=True)
    _compare_steps("native", (96, 130), 130, torch.bfloat16, torch.bfloat16, factored=False, noncontiguous=True)


@pytest.mark.slow
def test_compiled_backend_matches_eager_on_the_same_cases() -> None:
    """The compiled backend is registered too: same contract on two cases (each signature compiles for seconds)."""
    _compare_steps("compiled", (64, 96), 48, torch.float32, torch.float32, factored=True)
    _compare_steps("compiled", (3, 5, 70), 70, torch.float32, torch.float32, factored=False)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_native_muon_momentum_is_bit_identical(level: str, dtype: str) -> None:
    native.force_level(level)
    gen = torch.Generator().manual_seed(3)
    init = (torch.randn(48, 80, generator=gen) * 0.1).to(DTYPES[dtype])
    ps = [torch.nn.Parameter(init.clone()) for _ in range(2)]
    opts = [gefen.GefenMuon([p], lr=1e-2, normuon=True, backend=b) for p, b in zip(ps, ("eager", "native"))]
    for _ in range(3):
        g = _grad((48, 80), 80, gen).to(DTYPES[dtype])
        for p, opt in zip(ps, opts):
            p.grad = g.clone()
            opt.step()
    assert torch.equal(ps[0], ps[1])
    a, b = (ParamState.from_dict(opt.state[p]) for opt, p in zip(opts, ps))
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)


@pytest.mark.parametrize("level", LEVELS)
def test_native_non_contiguous_parameter_is_updated_in_place(level: str) -> None:
    """A column-major leaf parameter (requires_grad) steps natively in a contiguous copy written back in place:
    its layout is kept and its values, codes and magnitudes equal the eager step of a contiguous twin."""
    native.force_level(level)
    gen = torch.Generator().manual_seed(4)
    base = torch.randn(64, 48, generator=gen) * 0.1
    p = base.clone().t().requires_grad_()  # (48, 64), column-major
    q = torch.nn.Parameter(base.clone().t().contiguous())
    assert not p.is_contiguous()
    opt, twin = gefen.Gefen([p], lr=1e-2, backend="native"), gefen.Gefen([q], lr=1e-2, backend="eager")
    for _ in range(3):
        g = _grad((48, 64), 32, gen)
        p.grad, q.grad = g, g.clone()
        opt.step()
        twin.step()
        assert not p.is_contiguous() and p.requires_grad
        a, b = ParamState.from_dict(opt.state[p]), ParamState.from_dict(twin.state[q])
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)
        assert torch.allclose(p.detach(), q.detach(), rtol=0, atol=1e-7)
        _sync(opt, twin, [p], [q])


def test_native_param_groups_with_a_scheduler_match_eager() -> None:
    """One native call steps every group with that group's own per-step constants (computed once per group and
    step): three groups, two of them with equal hyperparameters, one parameter starting a step later (its own bias
    correction), and a scheduler changing every group's lr each step; codes and magnitudes equal the eager ones."""
    gen = torch.Generator().manual_seed(11)
    shapes = [(40, 48), (96,), (24, 64), (200,)]
    inits = [torch.randn(shape, generator=gen) * 0.1 for shape in shapes]
    runs = []
    for backend in ("eager", "native"):
        ps = [torch.nn.Parameter(x.clone()) for x in inits]
        groups = [
            {"params": [ps[0]], "lr": 1e-2, "weight_decay": 0.1},
            {"params": [ps[1]], "lr": 1e-2, "weight_decay": 0.1},
            {"params": [ps[2], ps[3]], "lr": 3e-3, "weight_decay": 0.0, "betas": (0.8, 0.99)},
        ]
        opt = gefen.Gefen(groups, backend=backend)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        runs.append((ps, opt, scheduler))
    for step in range(4):
        grads = [_grad(shape, None, gen) for shape in shapes]
        for ps, opt, scheduler in runs:
            for i, (p, g) in enumerate(zip(ps, grads)):
                p.grad = None if (i == 3 and step == 0) else g.clone()  # ps[3] starts at step 1
            opt.step()
            scheduler.step()
        (ref_ps, ref, _), (test_ps, test, _) = runs
        for i, (a, b) in enumerate(zip(ref_ps, test_ps)):
            if i == 3 and step == 0:
                assert not ref.state.get(a) and not test.state.get(b)
                continue
            r, t = ParamState.from_dict(ref.state[a]), ParamState.from_dict(test.state[b])
            assert int(r.step) == int(t.step) == step + (0 if i == 3 else 1)
            assert torch.equal(r.codes, t.codes), f"step {step}, param {i}: codes differ"
            assert torch.equal(r.scale, t.scale), f"step {step}, param {i}: magnitudes differ"
            assert torch.allclose(a, b, rtol=0, atol=1e-6), f"step {step}, param {i}: parameters differ"
        _sync(test, ref, test_ps, ref_ps)


def test_state_report_names_the_backend_that_ran_each_step() -> None:
    """``state_report()``'s ``backend``: ``None`` until a parameter steps in this process, then the backend that ran
    its latest step: the native one for CPU fp32 under ``backend="auto"``, eager for float64 (which it does not
    take) or when asked for; it follows a change of the group's backend; GefenMuon's momentum likewise."""
    gen = torch.Generator().manual_seed(5)
    p, q, r = (torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in [(16, 32), (40,), (8, 8)])
    d = torch.nn.Parameter(torch.randn(24, 16, dtype=torch.float64, generator=gen))
    opt = gefen.Gefen([("p", p), ("q", q), ("r", r), ("d", d)], lr=1e-3)
    assert [row["backend"] for row in opt.state_report()] == [None] * 4
    for t in (p, q, d):
        t.grad = torch.randn(t.shape, dtype=t.dtype, generator=gen)
    opt.step()
    assert [row["backend"] for row in opt.state_report()] == ["native", "native", None, "eager"]
    opt.param_groups[0]["backend"] = "eager"
    opt.step()
    assert [row["backend"] for row in opt.state_report()] == ["eager", "eager", None, "eager"]
    muon = gefen.GefenMuon([p])
    muon.step()
    assert muon.state_report()[0]["backend"] == "native"


def test_native_is_bit_identical_for_every_thread_count() -> None:
    """The work is split into tasks of a fixed size, so 1 and 2 threads give the same bits (deterministic=True)."""
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            gen = torch.Generator().manual_seed(5)
            params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((512, 384), (70000,))]
            opt = gefen.Gefen(params, lr=1e-2, weight_decay=0.1, backend="native", deterministic=True)
            for _ in range(3):
                for p in params:
                    p.grad = _grad(tuple(p.shape), None, gen)
                opt.step()
            results.append([p.detach().clone() for p in params] + [copy.deepcopy(opt.state_dict()["state"])])
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for a, b in zip(results[0][:2], other[:2]):
            assert torch.equal(a, b)
        for key, st in results[0][2].items():
            for name, value in st.items():
                if isinstance(value, torch.Tensor):
                    assert torch.equal(value, other[2][key][name]), name


@pytest.mark.parametrize("level", LEVELS)
def test_native_rows_of_a_sharded_parameter_equal_the_whole(level: str) -> None:
    """FSDP2 local shards: the native step of row slices (blocks inside rows) equals the step of the whole tensor."""
    native.force_level(level)
    gen = torch.Generator().manual_seed(7)
    p = torch.nn.Parameter(torch.randn(24, 64, generator=gen))
    opt = gefen.Gefen([p], lr=1e-2, factored_v_2d=False, backend="eager")
    p.grad = _grad((24, 64), 64, gen)
    opt.step()
    view = ParamState.from_dict(opt.state[p])
    table = opt._nearest_table(torch.device("cpu"))
    tables = (table.codebook, table.lut, table.thresholds)
    grad = _grad((24, 64), 64, gen)
    whole = {
        "param": p.detach().clone(),
        "codes": view.codes.clone(),
        "scale": view.scale.clone(),
        "v": view.second_moment.clone(),
    }
    rows = {k: v.clone() for k, v in whole.items()}
    period = view.period
    per_row = 64 // period

    def run(state: dict[str, torch.Tensor], lo: int, hi: int) -> None:
        b0, b1 = lo * per_row, hi * per_row
        native.native_step(
            "block",
            grad=grad[lo:hi].reshape(-1),
            codes=state["codes"][b0:b1],
            scale=state["scale"][b0:b1],
            tables=tables,
            steps=table.steps,
            period=period,
            beta1=0.9,
            param=state["param"][lo:hi].reshape(-1),
            second=(state["v"][b0:b1],),
            beta2=0.999,
            eps=1e-8,
            lr=1e-2,
            weight_decay=0.1,
            step=2,
        )

    run(whole, 0, 24)
    for lo, hi in ((0, 9), (9, 17), (17, 24)):  # uneven shards, as on 3 ranks
        run(rows, lo, hi)
    for key in whole:
        assert torch.equal(whole[key], rows[key]), key


@pytest.mark.parametrize("level", LEVELS)
def test_native_factored_rows_with_the_reduce_equal_the_whole(level: str) -> None:
    """FSDP2's factored moment: the row slices of a matrix (as on 3 uneven ranks), each with its own copy of the
    column moment, stepped in one call whose reduce sums their column sums and row-moment totals (as the
    all-reduce does), equal the native step of the whole matrix (the float64 sums are exact for this data)."""
    native.force_level(level)
    gen = torch.Generator().manual_seed(11)
    rows, cols, period = 30, 40, 20
    p = torch.nn.Parameter(torch.randn(rows, cols, generator=gen))
    opt = gefen.Gefen([p], lr=1e-2, backend="eager")
    p.grad = _grad((rows, cols), period, gen)
    opt.step()
    view = ParamState.from_dict(opt.state[p])
    table = opt._nearest_table(torch.device("cpu"))
    tables = (table.codebook, table.lut, table.thresholds)
    grad = _grad((rows, cols), period, gen)
    per_row = cols // view.period

    def state() -> dict[str, torch.Tensor]:
        return {
            "param": p.detach().clone(),
            "codes": view.codes.clone(),
            "scale": view.scale.clone(),
            "v_row": view.second_moment_row.clone(),
            "v_col": view.second_moment_col.clone(),
        }

    def record(st: dict[str, torch.Tensor], lo: int, hi: int, global_rows: int = 0, offset: int = 0):
        b0, b1 = lo * per_row, hi * per_row
        call = dict(
            grad=grad[lo:hi].reshape(-1),
            codes=st["codes"][b0:b1],
            scale=st["scale"][b0:b1],
            tables=tables,
            steps=table.steps,
            period=view.period,
            param=st["param"][lo:hi].reshape(-1),
            second=(st["v_row"][lo:hi], st["v_col"]),
            shape=(hi - lo, cols),
        )
        return native.record(
            "factored",
            **call,
            scalars=StepScalars(beta1=0.9, beta2=0.999, eps=1e-8, lr=1e-2, weight_decay=0.1),
            step=2,
            global_rows=global_rows,
            reduce_offset=offset,
        ), call

    whole = state()
    rec, keep = record(whole, 0, rows)
    native.run_records([rec])
    slices = ((0, 10), (10, 20), (20, 30))
    shards = [state() for _ in slices]
    records, calls = [], []
    for k, ((lo, hi), st) in enumerate(zip(slices, shards)):
        rec, call = record(st, lo, hi, global_rows=rows, offset=k * (cols + 1))
        records.append(rec)
        calls.append(call)
    buffer = torch.zeros(len(slices) * (cols + 1) + 1, dtype=torch.float64)
    seen = []

    def reduce(b: torch.Tensor) -> None:  # what an all-reduce over the three "ranks" gives each of them
        seen.append(float(b[-1]))
        pieces = b[:-1].view(len(slices), cols + 1)
        pieces.copy_(pieces.sum(0).expand_as(pieces))

    native.run_records(records, buffer, reduce)
    assert seen == [0.0]  # called once, no rank failed
    for (lo, hi), st in zip(slices, shards):
        b0, b1 = lo * per_row, hi * per_row
        assert torch.equal(st["param"][lo:hi], whole["param"][lo:hi])
        assert torch.equal(st["codes"][b0:b1], whole["codes"][b0:b1])
        assert torch.equal(st["v_row"][lo:hi], whole["v_row"][lo:hi])
        assert torch.equal(st["v_col"], whole["v_col"])


def test_native_reduce_failure_changes_nothing() -> None:
    """A reduce that fails (another rank's error, or a broken collective) refuses the step with nothing written."""
    gen = torch.Generator().manual_seed(3)
    p = torch.nn.Parameter(torch.randn(30, 40, generator=gen))
    opt = gefen.Gefen([p], lr=1e-2, backend="eager")
    p.grad = torch.randn(30, 40, generator=gen)
    opt.step()
    view = ParamState.from_dict(opt.state[p])
    table = opt._nearest_table(torch.device("cpu"))
    before = {k: v.clone() for k, v in opt.state[p].items()}
    param_before = p.detach().clone()
    rec = native.record(
        "factored",
        grad=torch.randn(1200, generator=gen),
        codes=view.codes,
        scale=view.scale,
        tables=(table.codebook, table.lut, table.thresholds),
        steps=table.steps,
        period=view.period,
        param=p.detach().view(-1),
        second=(view.second_moment_row, view.second_moment_col),
        shape=(30, 40),
        scalars=StepScalars(beta1=0.9, beta2=0.999, eps=1e-8, lr=1e-2),
        step=2,
        global_rows=60,
        reduce_offset=0,
    )

    def other_rank_failed(b: torch.Tensor) -> None:
        b[-1] += 1.0

    def broken(b: torch.Tensor) -> None:
        raise OSError("collective failed")

    with pytest.raises(RuntimeError, match="another rank failed"):
        native.run_records([rec], torch.zeros(42, dtype=torch.float64), other_rank_failed)
    with pytest.raises(OSError, match="collective failed"):
        native.run_records([rec], torch.zeros(42, dtype=torch.float64), broken)
    with pytest.raises(RuntimeError, match="rejected its arguments"):  # a sharded record needs the reduce form
        native.run_records([rec])
    assert torch.equal(p.detach(), param_before)
    assert all(torch.equal(opt.state[p][k], v) for k, v in before.items())


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values with NaN where the other has NaN (the payload of a NaN is not compared)."""
    return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()]))


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.2, 0.999)], ids=["low_lerp", "high_lerp"])
@pytest.mark.parametrize("factored", [False, True])
def test_native_propagates_nan_and_inf_like_eager(level: str, betas, factored: bool) -> None:
    """``nonfinite="propagate"``: gradients with NaN, +-Inf and finite values whose squares overflow fp32 go into the
    step, and the next step starts from the poisoned magnitudes (NaN or Inf ``a_old``). The native kernel's fast
    paths skip the per-element NaN test and the bucket clamp where they cannot matter (finite ``g`` and ``a_old``;
    ``|u| <= 1``): codes, magnitudes and parameters must still equal the eager reference, NaN for NaN."""
    native.force_level(level)
    shape, period = (16, 320), 320  # rows of 320: pass 2's four interleaved groups of 64, then one more group
    gen = torch.Generator().manual_seed(3)
    init = torch.randn(shape, generator=gen) * 0.1
    ref_p, test_p = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    kwargs = {"lr": 1e-2, "weight_decay": 0.1, "betas": betas, "factored_v_2d": factored, "nonfinite": "propagate"}
    ref = gefen.Gefen([ref_p], backend="eager", **kwargs)
    test = gefen.Gefen([test_p], backend="native", **kwargs)
    for step in range(4):
        g = _grad(shape, period, gen)
        if step in (1, 2):  # rows are blocks: one poison per row, each at a different place in its block
            g[1, 5], g[2, 200], g[3, 300], g[4, 64] = float("nan"), float("inf"), -float("inf"), 1e20
            g[5, 0], g[6, 100] = -3e19, 2e38
            g[1, 6], g[1, 90], g[1, 290] = 50.0, -80.0, 70.0  # a NaN block divides by 1: |u| > 1 beside the NaN
        before = ref_p.detach().clone()
        ref_p.grad, test_p.grad = g.clone(), g
        ref.step()
        test.step()
        r, t = ParamState.from_dict(ref.state[ref_p]), ParamState.from_dict(test.state[test_p])
        assert torch.equal(r.codes, t.codes), f"step {step}: codes differ"
        assert _same(r.scale, t.scale), f"step {step}: magnitudes differ"
        a, b = ref_p.detach(), test_p.detach()
        finite = a.isfinite()
        assert torch.equal(finite, b.isfinite()) and _same(a[~finite], b[~finite]), f"step {step}: NaN/Inf differ"
        if finite.any():  # a factored moment is NaN everywhere once its mean is (torch's clamp_min keeps NaN)
            update = (a[finite] - before[finite]).abs().max()  # the bound of _compare_steps (second-moment sums)
            assert (a[finite] - b[finite]).abs().max() <= 1e-6 * update + _ulp(a[finite]).max(), f"step {step}"
        _sync(test, ref, [test_p], [ref_p])
    assert bool(r.scale[:7].isnan().any() or r.scale[:7].isinf().any())  # the poison reached the magnitudes
