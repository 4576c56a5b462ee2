"""The Triton multi-tensor step (gefen.kernels.triton_plan), run by Triton's interpreter on CPU tensors, against the
eager reference (gefen.kernels.eager) and the native library.

Bounds asserted (what the backends may differ by, see gefen.kernels.eager): codes, magnitudes and GefenMuon's
``m̂`` bit-identical; second moments within 4 fp32 ulps (the block mean is rounded once from a float64 sum, the
reference sums in fp32); parameters within 1 ulp of the parameter plus 1e-6 of the step's size (what 4 ulps of v do to
the step size); on gradients whose sums of squares are exact in any order, everything bit-identical.

What the interpreter does NOT show (the GPU check must): the GPU's division and square-root instructions (here numpy's
correctly rounded fp32/fp64 operations stand in for ``div.rn``/``sqrt.rn``; Triton's plain ``/`` and ``tl.sqrt`` would
be approximate on the GPU, the kernels avoid them for fp32), flush-to-zero of subnormals (numpy never flushes), FP
contraction (the interpreter never contracts; the launches pass ``enable_fp_fusion=False``), races between programs and
memory ordering (the interpreter runs programs one after another), integer atomics under contention, compile-time
limits (register pressure of the tiles, ``tl.arange(0, 1)`` for period 1) and speed. The interpreter's own ``tl.fma``
rounds twice (``x*y+z`` in numpy); the ``exact_fma`` fixture replaces it by a round-once fp32 fma.
"""

from __future__ import annotations

import numpy as np
import pytest

triton = pytest.importorskip("triton")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from gefen.amp import usable_bound  # noqa: E402
from gefen.kernels import _triton_kernels as kernels  # noqa: E402
from gefen.kernels import native  # noqa: E402
from gefen.kernels.eager import reference_step  # noqa: E402
from gefen.kernels.triton_check import random_job, ulps_apart  # noqa: E402
from gefen.kernels.triton_plan import GROUP_FIELDS, TritonJob, build_plan  # noqa: E402
from gefen.math.codebook import HISTOGRAM_BINS, accumulate_histogram_, fit_codebook  # noqa: E402
from gefen.math.lookup import build_nearest_table  # noqa: E402
from tests.triton_interpreter import fma32 as _fma32  # noqa: E402
from tests.triton_interpreter import interpreted_kernels  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _interpreter():
    """Every test here runs the kernels in Triton's interpreter with a round-once fma (tests/triton_interpreter.py)."""
    with interpreted_kernels():
        yield


NATIVE = native.native_status().available
HYPER = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "lr": 1e-2, "weight_decay": 0.1}


def test_exact_fma_rounds_once() -> None:
    """A double-rounding case: 1 + 2^-11 + 2^-24 (an fp32 midpoint) + 2^-60 rounds up, the two-step sum down."""
    x = np.array([1 + 2**-12], dtype=np.float32)
    z = np.array([2**-60], dtype=np.float32)
    assert _fma32(x, x, z)[0] == np.float32(1 + 2**-11 + 2**-23)
    assert (x.astype(np.float64) ** 2 + 2**-60).astype(np.float32)[0] == np.float32(1 + 2**-11)


def _table(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(HISTOGRAM_BINS, dtype=torch.int64)
    g = torch.randn(64 * 512, generator=gen) * torch.exp(torch.randn(64, 1, generator=gen)).repeat(1, 512).view(-1)
    accumulate_histogram_(counts, g, 512)
    return build_nearest_table(fit_codebook(counts))


TABLE = _table()


def _groups(*rows: dict) -> torch.Tensor:
    return torch.tensor([[row[name] for name in GROUP_FIELDS] for row in rows], dtype=torch.float64)


def _job(kind, numel, period, shape=(0, 0), pdt=torch.float32, gdt=torch.float32, seed=0, group=0, counter=True):
    """A job with random state (some zero blocks) and a gradient with some all-zero blocks."""
    return random_job(kind, numel, period, shape, pdt, gdt, torch.Generator().manual_seed(seed), group, counter)


def _clone(job: TritonJob) -> TritonJob:
    def c(t):
        return None if t is None else t.clone()

    return TritonJob(job.kind, c(job.grad), c(job.codes), c(job.scale), job.period, job.group, c(job.param),
                     tuple(t.clone() for t in job.second), job.shape, c(job.out), c(job.counter))  # fmt: skip


def _state(job: TritonJob) -> list[torch.Tensor]:
    return [t for t in [job.codes, job.scale, job.param, *job.second, job.out, job.counter] if t is not None]


def _reference(job: TritonJob, hyper: dict, step: int) -> None:
    reference_step(job.kind, grad=job.grad, codes=job.codes, scale=job.scale, table=TABLE, period=job.period,
                   param=job.param, second=job.second, out=job.out, shape=job.shape, step=step, **hyper)  # fmt: skip
    if job.counter is not None:
        job.counter += 1


def _native(job: TritonJob, hyper: dict, step: int) -> None:
    tables = (TABLE.codebook, TABLE.lut, TABLE.thresholds)
    native.native_step(job.kind, grad=job.grad, codes=job.codes, scale=job.scale, tables=tables, steps=TABLE.steps,
                       period=job.period, param=job.param, second=job.second, out=job.out, shape=job.shape,
                       step=step, **hyper)  # fmt: skip


_ulps = ulps_apart


def _check_close(ours: TritonJob, theirs: TritonJob, before: torch.Tensor | None, what: str, v_ulps: int = 4) -> None:
    assert torch.equal(ours.codes, theirs.codes), f"{what}: codes"
    assert torch.equal(ours.scale, theirs.scale), f"{what}: magnitudes"
    if ours.out is not None:
        assert torch.equal(ours.out, theirs.out), f"{what}: m_hat"
    for a, b in zip(ours.second, theirs.second):
        assert _ulps(a, b) <= v_ulps, f"{what}: second moment {_ulps(a, b)} ulps"
    if ours.param is not None:
        p, q = ours.param.float(), theirs.param.float()
        inf = torch.tensor(float("inf"), dtype=theirs.param.dtype)
        ulp = (torch.nextafter(theirs.param.abs(), inf).float() - q.abs())
        bound = ulp + 1e-6 * (q - before.float()).abs()
        assert bool(((p - q).abs() <= bound).all()), f"{what}: parameter off by {(p - q).abs().max()}"


def _mixed_jobs(pdt, gdt, seed=0, extra=0):
    """Block, factored and momentum jobs with periods 1, 48, 100 and 768 (and ``extra`` more block jobs)."""
    specs = [
        ("block", 96, 1, (0, 0)),
        ("block", 48 * 6, 48, (0, 0)),
        ("factored", 20 * 30, 100, (20, 30)),
        ("factored", 12 * 64, 768, (12, 64)),
        ("momentum", 100 * 4, 100, (0, 0)),
        ("block", 768 * 2, 768, (0, 0)),
        ("momentum", 48 * 3, 1, (0, 0)),
    ] + [("block", 48 * 2, 48, (0, 0))] * extra
    return [_job(k, n, p, s, pdt, gdt, seed=seed + i) for i, (k, n, p, s) in enumerate(specs)]


@pytest.mark.parametrize("pdt,gdt", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                     (torch.float16, torch.bfloat16)])  # fmt: skip
def test_plan_matches_reference_and_native_over_steps(pdt, gdt) -> None:
    jobs = _mixed_jobs(pdt, gdt)
    refs = [_clone(j) for j in jobs]
    nats = [_clone(j) for j in jobs]
    plan = build_plan(jobs, TABLE.codebook, TABLE.lut, TABLE.thresholds, TABLE.steps, stat_rows=8)
    groups = _groups(HYPER)
    for step in (1, 2, 3):
        before = [None if j.param is None else j.param.clone() for j in jobs]
        flags = plan.run(groups, check=True)
        assert flags.tolist() == [1] * len(jobs) and int(plan.applied) == 1
        for i, (job, ref, nat) in enumerate(zip(jobs, refs, nats)):
            _reference(ref, HYPER, step)
            _check_close(job, ref, before[i], f"step {step} jobs[{i}] vs reference")
            assert int(job.counter) == step
            if NATIVE:
                _native(nat, HYPER, step)
                _check_close(job, nat, before[i], f"step {step} jobs[{i}] vs native")
                _copy_state(nat, ref)  # the next step starts from the same state (second moments may differ)
            _copy_state(job, ref)


def test_blocks_longer_than_a_tile_loop_over_tiles() -> None:
    """Periods above the 2048-element tile (each block read in tiles, twice): block, factored and momentum, fp16 and
    bf16 gradients, two checked steps against the reference and the native library."""
    jobs = [_job("block", 2 * 4100, 4100, pdt=torch.bfloat16, gdt=torch.float16, seed=31),
            _job("factored", 2 * 2500, 2500, (2, 2500), gdt=torch.bfloat16, seed=32),
            _job("momentum", 2 * 2100, 2100, gdt=torch.float16, seed=33)]  # fmt: skip
    refs, nats = [_clone(j) for j in jobs], [_clone(j) for j in jobs]
    plan = build_plan(jobs, TABLE.codebook, TABLE.lut, TABLE.thresholds, TABLE.steps)
    assert [launch.loop for launch in plan._launches] == [True]
    for step in (1, 2):
        before = [None if j.param is None else j.param.clone() for j in jobs]
        assert plan.run(_groups(HYPER), check=True).tolist() == [1, 1, 1]
        for i, (job, ref, nat) in enumerate(zip(jobs, refs, nats)):
            _reference(ref, HYPER, step)
            _check_close(job, ref, before[i], f"step {step} jobs[{i}] vs reference")
            if NATIVE:
                _native(nat, HYPER, step)
                _check_close(job, nat, before[i], f"step {step} jobs[{i}] vs native")
                _copy_state(nat, job)
            _copy_state(ref, job)


def _copy_state(dst: TritonJob, src: TritonJob) -> None:
    for a, b in zip(_state(dst), _state(src)):
        a.copy_(b)


def test_exact_sums_give_bit_identical_results() -> None:
    """Gradients k·2^-8 (|k| <= 15): every sum of squares is exact in any order, so the second moments (means
    rounded once) are bit-identical to the reference's, and every factored and momentum result to the native
    library's (whose block mean is ``sum·fp32(1/P)``, two roundings: block v within 1 ulp there).

    Parameters against the reference stay within the general bound: the reference's last operations are torch's
    (``add_(d, alpha=step)``, whose fma or not is torch's choice, and torch 2.13's CPU ``tensor / python_scalar``,
    a true division, where the native library and torch on CUDA multiply by the fp32 reciprocal of ``sqrt(bc2)``),
    one rounding of the update away: up to 26 ulps of a parameter near 0, far below 1e-6 of the step."""
    jobs = _mixed_jobs(torch.float32, torch.float32, seed=7)
    for i, job in enumerate(jobs):
        gen = torch.Generator().manual_seed(100 + i)
        job.grad.copy_(torch.randint(-15, 16, job.grad.shape, generator=gen).float() / 256)
    refs = [_clone(j) for j in jobs]
    nats = [_clone(j) for j in jobs]
    plan = build_plan(jobs, TABLE.codebook, TABLE.lut, TABLE.thresholds, TABLE.steps, stat_rows=5)
    hyper = dict(HYPER, weight_decay=0.0)
    for step in (1, 2):
        plan.run(_groups(hyper), check=False)
        for i, (job, ref, nat) in enumerate(zip(jobs, refs, nats)):
            what = f"step {step} jobs[{i}] ({job.kind}, P={job.period})"
            before = ref.param.clone() if ref.param is not None else None
            _reference(ref, hyper, step)
            _check_close(job, ref, before, what, v_ulps=0)
            assert torch.equal(job.counter, ref.counter), what
            if NATIVE:
                before = nat.param.clone() if nat.param is not None else None
                _native(nat, hyper, step)
                nat.counter += 1
                if job.kind == "block":  # the native block mean is sum·fp32(1/P), two roundings: v within 1 ulp
                    _check_close(job, nat, before, f"{what} vs native", v_ulps=1)
                else:
                    assert all(torch.equal(a, b) for a, b in zip(_state(job), _state(nat))), f"{what} vs native"
                _copy_state(nat, job)
            _copy_state(ref, job)


def test_values_on_code_thresholds_and_zero_blocks() -> None:
    """beta1 = 0 makes m = g exactly, so u = g / max|g|: gradients placed on every threshold, one float either
    side of it, and blocks that are all zero."""
    thresholds = TABLE.thresholds[: 255][TABLE.thresholds[:255] < 1.0]
    values = torch.stack([thresholds, torch.nextafter(thresholds, torch.tensor(2.0)),
                          torch.nextafter(thresholds, torch.tensor(-2.0))]).reshape(-1)  # fmt: skip
    period = 100
    blocks = -(-values.numel() // (period - 1)) + 2
    grad = torch.zeros(blocks, period)
    flat = grad[: blocks - 2, 1:].reshape(-1)
    flat[: values.numel()] = values
    grad[: blocks - 2, 1:] = flat.view(blocks - 2, period - 1)
    grad[: blocks - 2, 0] = 1.0  # max|g| = 1: u = g exactly
    job = _job("momentum", blocks * period, period, seed=3)
    job.grad.copy_(grad.view(-1))
    ref = _clone(job)
    hyper = dict(HYPER, beta1=0.0)
    build_plan([job], TABLE.codebook, TABLE.lut, TABLE.thresholds, TABLE.steps).run(_groups(hyper), check=True)
    _reference(ref, hyper, 1)
    assert torch.equal(job.codes, ref.codes) and torch.equal(job.scale, ref.scale) and torch.equal(job.out, ref.out)
    assert job.scale[-2:].tolist() == [0.0, 0.0]


def _bad_value(job: TritonJob, kind: str) -> float:
    return {"nan": float("nan"), "inf": float("inf"), "big": usable_bound(job.grad.numel()) * 1.01}[kind]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy on the Inf gradient
@pytest.mark.parametrize("bad", ["nan", "inf", "big"])
def test_unusable_gradient_changes_nothing(bad: str) -> None:
    jobs = _mixed_jobs(torch.float32, torch.float32, seed=11)
    plan = build_plan(jobs, TABLE.codebook, TABLE.lut, TABLE.thresholds, TABLE.steps, stat_rows=8)
    groups = _groups(HYPER)
    plan.run(groups, check=True)  # one good step first
    for victim in (2, 5):  # a factored and a block job
        before = [[t.clone() for t in _state(j)] for j in jobs]
        saved = jobs[victim].grad[7].clone()
        jobs[victim].grad[7] = _bad_value(jobs[victim], bad)
        flags = plan.run(groups, check=True)
        assert int(plan.applied) == 0
        assert flags.tolist() == [0 if i == victim else 1 for i in range(len(jobs))]
        for job, old in zip(jobs, before):
            for a, b in zip(_state(job), old):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # bit-identical, NaN included
        jobs[victim].grad[7] = saved
    flags = plan.run(groups, check=True)  # usable again: applied (the previous run's tag does not stick)
    assert int(plan.applied) == 1 and flags.tolist() == [1] * len(jobs)
    assert [int(j.counter) for j in jobs] == [2] * len(jobs)


def test_gradient_at_the_usable_bound_is_applied() -> None:
    job = _job("block", 64, 16, seed=5)
    bound = usable_bound(64)
    job.grad[3] = torch.tensor(bound, dtype=torch.float32)  # fp32(bound): on the bound, usable
    plan = build_plan([job], TABLE.codebook, TABLE.lut, TABLE.thresholds, TABLE.steps)
    assert plan.run(_groups(HYPER), check=True).tolist() == [1] and int(plan.applied) == 1


def test_unchecked_step_propagates_nan_like_the_reference() -> None:
    job = _job("block", 96, 48, seed=9)
    job.grad[5] = float("nan")
    ref = _clone(job)
    plan = build_plan([job], TABLE.codebook, TABLE.lut, TABLE.thresholds, TABLE.steps)
    assert plan.run(_groups(HYPER), check=False).tolist() == [1] and int(plan.applied) == 1
    _reference(ref, HYPER, 1)
    for a, b in zip(_state(job), _state(ref)):  # NaN where the reference has NaN (any sign or payload), else equal
        if a is job.param:  # the block step size's one rounding (see test_exact_sums_give_bit_identical_results)
            assert torch.equal(a.isnan(), b.isnan()) and _ulps(a[~a.isnan()], b[~b.isnan()]) <= 1
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert bool(job.scale.isnan().any()) and bool(job.param.isnan().any())


def test_two_groups_and_a_momentum_job_without_counter() -> None:
    other = dict(HYPER, beta1=0.3, beta2=0.95, lr=3e-3, weight_decay=0.0)
    jobs = [_job("block", 96, 48, seed=1, group=1), _job("momentum", 96, 48, seed=2, counter=False),
            _job("factored", 60, 12, (6, 10), seed=3, group=1)]  # fmt: skip
    refs = [_clone(j) for j in jobs]
    plan = build_plan(jobs, TABLE.codebook, TABLE.lut, TABLE.thresholds, TABLE.steps)
    plan.run(_groups(HYPER, other), check=True)
    for job, ref in zip(jobs, refs):
        _reference(ref, other if job.group == 1 else HYPER, 1)
        _check_close(job, ref, _clone(ref).param if ref.param is not None else None, job.kind)


def test_rebuilt_plan_after_a_new_gradient_gives_the_same_result() -> None:
    jobs = _mixed_jobs(torch.float32, torch.float32, seed=21)
    twins = [_clone(j) for j in jobs]
    plan = build_plan(jobs, TABLE.codebook, TABLE.lut, TABLE.thresholds, TABLE.steps)
    assert plan.matches(jobs) and not plan.matches(twins) and not plan.matches(jobs[:-1])
    moved = list(jobs)
    moved[3] = TritonJob(**{**jobs[3].__dict__, "grad": jobs[3].grad.clone()})
    assert not plan.matches(moved)
    plan.run(_groups(HYPER), check=True)
    build_plan(twins, TABLE.codebook, TABLE.lut, TABLE.thresholds, TABLE.steps).run(_groups(HYPER), check=True)
    for job, twin in zip(jobs, twins):
        for a, b in zip(_state(job), _state(twin)):
            assert torch.equal(a, b)


def _count_launches(monkeypatch) -> list[str]:
    calls: list[str] = []
    for name in ("stats_kernel", "finalize_kernel", "update_kernel"):
        fn = getattr(kernels, name)
        original = fn.run

        def run(*args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(fn, "run", run)
    return calls


def test_launch_count_does_not_depend_on_the_number_of_jobs(monkeypatch) -> None:
    """2 jobs and 10 jobs of the same period classes (1 and 48) launch the same kernels: statistics, finalize, one
    update launch per class (the statistics pass runs without check too: the factored sums)."""
    calls = _count_launches(monkeypatch)
    counts = {}
    for pairs in (1, 5):
        jobs = []
        for k in range(pairs):
            jobs += [_job("block", 64, 1, seed=k), _job("factored", 96, 48, (6, 16), seed=50 + k)]
        plan = build_plan(jobs, TABLE.codebook, TABLE.lut, TABLE.thresholds, TABLE.steps)
        for check in (True, False):
            calls.clear()
            plan.run(_groups(HYPER), check=check)
            counts[(len(jobs), check)] = list(calls)
    expected = ["stats_kernel", "finalize_kernel", "update_kernel", "update_kernel"]
    assert counts[(2, True)] == counts[(10, True)] == counts[(2, False)] == counts[(10, False)] == expected


def test_run_reads_nothing_back_to_the_host() -> None:
    jobs = _mixed_jobs(torch.bfloat16, torch.float32, seed=4)
    plan = build_plan(jobs, TABLE.codebook, TABLE.lut, TABLE.thresholds, TABLE.steps)

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    with Ops() as ops:
        plan.run(_groups(HYPER), check=True)
    assert ops.seen and not ops.seen & {"aten._local_scalar_dense", "aten.is_nonzero", "aten.item"}


def test_step_constants_are_computed_on_the_device_as_on_the_host() -> None:
    """The finalize kernel's fp32 constants against the float64 formulas of gefen.kernels.scalars.derive, t = 1..12."""
    job = _job("factored", 60, 12, (6, 10), seed=1)
    plan = build_plan([job], TABLE.codebook, TABLE.lut, TABLE.thresholds, TABLE.steps)
    hyper = dict(HYPER, beta1=0.95, beta2=0.9999, lr=3e-4)
    f32 = lambda x: float(np.float32(x))  # noqa: E731
    for t in range(1, 13):
        job.counter.fill_(t - 1)
        plan.run(_groups(hyper), check=False)
        bc1, bc2 = 1.0 - hyper["beta1"] ** t, 1.0 - hyper["beta2"] ** t
        expected = {"w": f32(1 - hyper["beta1"]), "decay": f32(1 - hyper["lr"] * hyper["weight_decay"]),
                    "step": f32(-hyper["lr"] * (1.0 / bc1)), "inv_bc1": f32(1.0 / bc1), "bc2": f32(bc2),
                    "inv_root_bc2": float(np.float32(1.0) / np.float32(bc2**0.5)), "eps": f32(hyper["eps"]),
                    "one_minus_beta2": f32(1 - hyper["beta2"])}  # fmt: skip
        row = plan._t["consts"].tolist()
        for name, value in expected.items():
            assert row[kernels.CONSTANT_FIELDS.index(name)] == value, (t, name)


def test_device_power_matches_python() -> None:
    """beta**t on the device (pow_int's arithmetic) within 2 float64 ulps of Python's for a sample of t <= 10**6
    (the full range is measured in pow_int's docstring), and fp32(1 - beta**t) identical."""
    sample = torch.randint(1001, 10**6, (3000,), generator=torch.Generator().manual_seed(0))
    t = torch.cat([torch.arange(1, 1001), sample])
    for beta in (0.9, 0.99, 0.999, 0.9999):
        out = torch.empty(t.numel(), dtype=torch.float64)
        kernels.pow_kernel[(1,)](torch.tensor([beta], dtype=torch.float64), t, out, t.numel(), BLOCK=4096)
        ref = torch.tensor([beta ** int(k) for k in t], dtype=torch.float64)
        spacing = torch.from_numpy(np.spacing(ref.abs().numpy()))
        assert bool(((out - ref).abs() <= 2 * spacing).all()), beta
        assert torch.equal((1 - out).float(), (1 - ref).float()), beta


def _bad_jobs() -> list[tuple[str, object]]:
    def job(**change):
        base = _job("block", 96, 48, seed=1).__dict__
        return TritonJob(**{**base, **change})

    shared = _job("block", 96, 48, seed=2)
    return [
        (r"period=40 must be an int >= 1 dividing numel=96", job(period=40)),
        (r"codes dtype torch.int32", job(codes=torch.zeros(2, 48, dtype=torch.int32))),
        (r"scale has 3 elements, expected 2", job(scale=torch.zeros(3))),
        (r"counter is required", job(counter=None)),
        (r"param must be contiguous", job(param=torch.zeros(96, 2)[:, 0])),
        (r"second must be \(v,\)", job(second=())),
        (r"kind must be one of", job(kind="adam")),
        (r"shape=\(5, 20\) must be \(R, C\)",
         job(kind="factored", shape=(5, 20), second=(torch.zeros(5), torch.zeros(20)))),
        (r"out is only for momentum", job(out=torch.zeros(96))),
        (r"overlap in memory", [shared, TritonJob(**{**_job("block", 96, 48).__dict__, "scale": shared.scale})]),
    ]  # fmt: skip


@pytest.mark.parametrize("message,bad", _bad_jobs(), ids=lambda x: x if isinstance(x, str) else "")
def test_build_plan_refuses_jobs_that_do_not_fit(message: str, bad) -> None:
    jobs = bad if isinstance(bad, list) else [_job("momentum", 48, 48, seed=3), bad]
    snapshot = [[t.clone() for t in _state(j)] for j in jobs]
    with pytest.raises(ValueError, match=message) as info:
        build_plan(jobs, TABLE.codebook, TABLE.lut, TABLE.thresholds, TABLE.steps)
    assert "jobs[1]" in str(info.value)
    for job, old in zip(jobs, snapshot):
        assert all(torch.equal(a, b) for a, b in zip(_state(job), old))


def test_run_refuses_a_group_table_that_does_not_fit() -> None:
    plan = build_plan([_job("block", 96, 48, group=1)], TABLE.codebook, TABLE.lut, TABLE.thresholds, TABLE.steps)
    with pytest.raises(ValueError, match="G > 1"):
        plan.run(_groups(HYPER), check=True)
    with pytest.raises(ValueError, match="float64"):
        plan.run(_groups(HYPER, HYPER).float(), check=True)
