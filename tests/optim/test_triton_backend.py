"""Gefen and GefenMuon on the Triton backend (``backend="triton"``), run on CPU tensors by Triton's interpreter.

The interpreter runs the same kernels one program after another (no GPU numerics, no races; see
tests/kernels/test_triton_plan.py for what it does and does not show); here the optimizer-level contract is checked:
the same training as the native backend, the plan reused across steps and rebuilt when a tensor moves, a NaN step
decided on the device changing nothing, and no host read in a steady step.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

import gefen
from gefen.kernels.native import native_status
from gefen.state import ParamState

pytest.importorskip("triton")

from tests.triton_interpreter import HostReads, interpreted_kernels  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _interpreter():
    """The kernels in Triton's interpreter (CPU tensors), with a round-once fma (tests/triton_interpreter.py)."""
    with interpreted_kernels():
        yield


needs_native = pytest.mark.skipif(not native_status().available, reason="native library not built")


def _params(seed: int, dtype: torch.dtype = torch.float32) -> list[tuple[str, torch.nn.Parameter]]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"weight": (24, 48), "thin": (96, 8), "bias": (24,), "conv": (4, 3, 16)}
    return [(n, torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype))) for n, s in shapes.items()]


def _grads(params: list[tuple[str, torch.nn.Parameter]], step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    out = []
    for _, p in params:
        rows = torch.rand(p.shape[0], *([1] * (p.dim() - 1)), generator=gen) * 4
        out.append((torch.randn(p.shape, generator=gen) * rows).to(p.dtype))
    return out


def _train(backend: str, steps: int, dtype: torch.dtype = torch.float32, **kwargs: object) -> tuple:
    params = _params(0, dtype)
    opt = gefen.Gefen(params, lr=1e-2, weight_decay=0.1, backend=backend, **kwargs)
    for step in range(steps):
        for (_, p), g in zip(params, _grads(params, step)):
            p.grad = g
        opt.step()
    return params, opt


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_trains_like_native(dtype: torch.dtype) -> None:
    """Three steps of block, factored and 1-D parameters: codes and magnitudes bit-identical to the native backend,
    second moments within 4 ulp (the block mean is rounded once from a float64 sum; the native library multiplies an
    fp32 sum by fp32(1/P)), so parameters within 2 ulp of their dtype plus 1e-5 of the three steps' update."""
    initial = [p.detach().float() for _, p in _params(0, dtype)]
    native_params, native = _train("native", 3, dtype)
    triton_params, triton = _train("triton", 3, dtype)
    assert torch.equal(native.codebook, triton.codebook)
    for (name, a), (_, b) in zip(native_params, triton_params):
        sa, sb = ParamState.from_dict(native.state[a]), ParamState.from_dict(triton.state[b])
        assert torch.equal(sa.codes, sb.codes), name
        assert torch.equal(sa.scale, sb.scale), name
        assert int(sa.step) == int(sb.step) == 3
        for key in ("second_moment", "second_moment_row", "second_moment_col"):
            if key in native.state[a]:
                torch.testing.assert_close(native.state[a][key], triton.state[b][key], rtol=4 * 2**-23, atol=0)
    for (name, a), (_, b), start in zip(native_params, triton_params, initial):
        a, b = a.detach().float(), b.detach().float()
        bound = 2 * torch.finfo(dtype).eps * a.abs() + 1e-5 * (a - start).abs()
        assert bool(((a - b).abs() <= bound).all()), name
    assert triton.global_step == 3


def test_triton_plan_is_reused_and_rebuilt_when_a_gradient_moves() -> None:
    params, opt = _train("triton", 2)
    backend = opt._backends.get("triton")
    (plan,) = [prepared.plan for prepared in backend._prepared.values()]
    for (_, p), g in zip(params, _grads(params, 5)):
        p.grad.copy_(g)  # same addresses: the same plan
    opt.step()
    assert [prepared.plan for prepared in backend._prepared.values()] == [plan]
    for (_, p), g in zip(params, _grads(params, 6)):
        p.grad = g  # new gradient tensors: a new plan, the same result as a fresh run
    opt.step()
    assert len(backend._prepared) == 1 and next(iter(backend._prepared.values())).plan is not plan
    reference_params, reference = _train("triton", 2)  # a plan built at every step: the same bits
    for (_, p), g in zip(reference_params, _grads(reference_params, 5)):
        p.grad = g
    reference.step()
    for (_, p), g in zip(reference_params, _grads(reference_params, 6)):
        p.grad = g
    reference.step()
    for (_, a), (_, b) in zip(params, reference_params):
        assert all(torch.equal(opt.state[a][k], reference.state[b][k]) for k in opt.state[a])
        assert torch.equal(a, b)


def test_triton_nan_step_is_skipped_on_the_device_and_changes_nothing() -> None:
    params, opt = _train("triton", 2, nonfinite="skip")
    before = {(n, k): v.clone() for n, p in params for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
    values = [p.detach().clone() for _, p in params]
    grads = _grads(params, 7)
    grads[1][3, 2] = float("nan")
    for (_, p), g in zip(params, grads):
        p.grad = g
    with pytest.warns(UserWarning, match="thin"):
        opt.step()
    assert opt.skipped_steps == 1 and opt.global_step == 2
    after = {(n, k): v for n, p in params for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
    assert before.keys() == after.keys() and len(before) > 4 * len(params) - 1
    assert all(torch.equal(before[key], after[key]) for key in before)
    assert all(torch.equal(v, p.detach()) for v, (_, p) in zip(values, params))
    for (_, p), g in zip(params, _grads(params, 8)):  # the next good step runs from the same plan and counters
        p.grad = g
    opt.step()
    assert opt.global_step == 3 and all(int(opt.state[p]["step"]) == 3 for _, p in params)


def test_triton_steady_step_reads_nothing_on_the_host() -> None:
    """A steady step (plan built, nonfinite="propagate": no check) makes no ``.item()``/``bool()`` host read."""
    params, opt = _train("triton", 2, nonfinite="propagate")
    for (_, p), g in zip(params, _grads(params, 3)):
        p.grad.copy_(g)
    with HostReads() as mode:
        opt.step()
    assert mode.reads == 0
    assert opt.global_step == 3


@needs_native
@pytest.mark.parametrize("budget", [1 << 24, 32 * 48])
def test_gefen_muon_momentum_on_triton_matches_native(monkeypatch: pytest.MonkeyPatch, budget: int) -> None:
    """GefenMuon's momenta on Triton: bit-identical to native, in one part or one part per matrix (the parts share
    one m-hat arena, each consumed before the next part runs)."""
    import gefen.optim.muon as muon_module

    monkeypatch.setattr(muon_module, "MOMENTUM_PART_ELEMENTS", budget)
    runs = {}
    for backend in ("native", "triton"):
        ws = [torch.nn.Parameter(torch.randn(32, 48, generator=torch.Generator().manual_seed(1))) for _ in range(2)]
        opt = gefen.GefenMuon(ws, lr=0.02, backend=backend)
        for step in range(2):
            g = torch.Generator().manual_seed(10 + step)
            for w in ws:
                w.grad = torch.randn(w.shape, generator=g)
            opt.step()
        runs[backend] = (ws, opt)
    (wa, oa), (wb, ob) = runs["native"], runs["triton"]
    for a, b in zip(wa, wb):
        assert torch.equal(oa.state[a]["first_moment_codes"], ob.state[b]["first_moment_codes"])
        assert torch.equal(oa.state[a]["first_moment_scale"], ob.state[b]["first_moment_scale"])
        assert torch.equal(a, b)  # the same m̂ bits: Newton-Schulz and the write are the same torch ops
    arena = ob._backends.get("triton")._arena[torch.device("cpu")]
    assert arena.numel() == (2 if budget > 32 * 48 else 1) * 32 * 48  # one part's momenta, not the model's


def test_triton_compile_failure_refuses_the_step_before_any_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton compiles every kernel of a new plan in ``prepare`` (``TritonPlan.compile``), so a kernel that cannot be
    built for the device refuses the step with nothing changed, not half-way through it."""
    from gefen.kernels import triton_plan

    compiled = []
    original = triton_plan.TritonPlan.compile
    monkeypatch.setattr(triton_plan.TritonPlan, "compile", lambda plan: compiled.append(original(plan)))
    params, opt = _train("triton", 1)
    assert len(compiled) == 1  # the plan of the first step was compiled (a no-op launch under the interpreter)

    def fail(plan: object) -> None:
        raise RuntimeError("ptxas: out of registers")

    monkeypatch.setattr(triton_plan.TritonPlan, "compile", fail)
    before = {name: p.detach().clone() for name, p in params}
    state = {(name, k): v.clone() for name, p in params for k, v in opt.state[p].items()}
    for (_, p), g in zip(params, _grads(params, 4)):
        p.grad = g  # new gradient tensors: a new plan
    with pytest.raises(gefen.StepError, match="could not be built or compiled: RuntimeError: ptxas.*Nothing was"):
        opt.step()
    assert all(torch.equal(before[name], p) for name, p in params)
    assert all(torch.equal(state[name, k], v) for name, p in params for k, v in opt.state[p].items())
    assert opt.global_step == 1


class _SlowEvent:
    """Stands in for the CUDA event of a pending check whose flags have not arrived yet (the CPU has no events)."""

    arrived = False

    def query(self) -> bool:
        return _SlowEvent.arrived

    def synchronize(self) -> None:
        _SlowEvent.arrived = True


@pytest.mark.parametrize("moved", [False, True, "dropped"])
def test_triton_steps_do_not_wait_for_earlier_device_decisions(monkeypatch: pytest.MonkeyPatch, moved: object) -> None:
    """Under ``nonfinite="skip"`` a steady Triton step starts without waiting for the previous steps' flags (their
    counters are the plan's device copies): three steps, the middle one with a NaN, run while no flag has arrived;
    they settle in order when the host looks, and the training equals one in which every step was settled at once
    (the NaN step skipped, its counters not advanced, the step after it using t = 3). No step reads the device.
    ``moved``: new gradient tensors every step, so each step rebuilds its plan from the previous plan's device
    counters (not the lagging host ones). ``"dropped"``: the last step leaves one parameter without a gradient, a new
    batch whose plan starts from the host counters, once the pending steps are settled."""
    from gefen.nonfinite import PendingCheck

    original = PendingCheck.of.__func__  # type: ignore[attr-defined]

    def slow(cls, flags, names, counters):  # type: ignore[no-untyped-def]
        pending = original(cls, flags, names, counters)
        pending.event = _SlowEvent()
        return pending

    runs = {}
    for deferred in (False, True):
        params, opt = _train("triton", 2, nonfinite="skip")
        if deferred:
            monkeypatch.setattr(PendingCheck, "of", classmethod(slow))
            _SlowEvent.arrived = False
        for step in (3, 4, 5):
            grads = _grads(params, step)
            if step == 4:
                grads[0][1, 1] = float("nan")
            for (_, p), g in zip(params, grads):
                if moved == "dropped" and step == 5 and p is params[-1][1]:
                    p.grad = None
                elif moved:
                    p.grad = g
                else:
                    p.grad.copy_(g)  # the same gradient tensors: the plan is reused
            if deferred:
                settles = moved == "dropped" and step == 5  # the new batch's plan settles the NaN step first
                with HostReads() as mode, pytest.warns(UserWarning, match="weight") if settles else nullcontext():
                    opt.step()
                assert moved or mode.reads == 0, f"step {step}: {mode.reads} host reads"
            elif step != 4:
                opt.step()
            else:
                with pytest.warns(UserWarning, match="weight"):
                    opt.step()
        if deferred and moved == "dropped":
            assert len(opt._pending_checks) == 1  # settled before the new batch's plan read the host counters
            assert _SlowEvent.arrived
        elif deferred:
            assert len(opt._pending_checks) == 3  # nothing has waited for the device
            assert all(int(opt.state[p]["step"]) == 2 for _, p in params)  # the host counters lag
            with pytest.warns(UserWarning, match="weight") if moved != "dropped" else nullcontext():
                assert opt.skipped_steps == 1  # the host looks: all settled, oldest first
            monkeypatch.undo()
        assert opt.skipped_steps == 1 and opt.global_step == 4
        runs[deferred] = (params, opt)
    last = 3 if moved == "dropped" else 4
    (a, oa), (b, ob) = runs[False], runs[True]
    for (_, p), (_, q) in zip(a, b):
        assert torch.equal(p, q)
        assert all(torch.equal(oa.state[p][k], ob.state[q][k]) for k in oa.state[p])
    assert [int(ob.state[q]["step"]) for _, q in b] == [4] * (len(b) - 1) + [last]


def test_triton_load_state_dict_replaces_the_device_counters() -> None:
    """A checkpoint loaded into an optimizer whose plans hold device counters of later steps: the next step uses the
    loaded counters (the plans are dropped with the state they were built on), as a fresh optimizer loaded from the
    same checkpoint does."""
    import copy

    params, opt = _train("triton", 2)
    saved = copy.deepcopy(opt.state_dict())
    values = [p.detach().clone() for _, p in params]
    for step in (2, 3):  # the plan's device counters move on to 4
        for (_, p), g in zip(params, _grads(params, step)):
            p.grad = g
        opt.step()
    fresh_params = _params(0)
    for (_, p), v in zip(fresh_params, values):
        p.data.copy_(v)
    fresh = gefen.Gefen(fresh_params, lr=1e-2, weight_decay=0.1, backend="triton")
    fresh.load_state_dict(copy.deepcopy(saved))
    opt.load_state_dict(saved)
    for ps, o in ((params, opt), (fresh_params, fresh)):
        for (_, p), v in zip(ps, values):
            p.data.copy_(v)
        for (_, p), g in zip(ps, _grads(ps, 9)):
            p.grad = g
        o.step()
    for (_, p), (_, q) in zip(params, fresh_params):
        assert torch.equal(p, q)
        assert int(opt.state[p]["step"]) == int(fresh.state[q]["step"]) == 3


@needs_native
def test_triton_a_state_reset_by_hand_restarts_its_counter() -> None:
    """One parameter's state cleared by hand after two steps: it starts again (period, counter 1) while the others
    go on, and the rebuilt plan counts it from its new state, not from the old plan's device counter. The same as
    the native backend doing the same (codes bit-identical, parameters within the bound of the test above)."""
    runs = []
    for backend in ("native", "triton"):
        params = _params(0)
        opt = gefen.Gefen(params, lr=1e-2, weight_decay=0.1, backend=backend)
        for step in range(4):
            if step == 2:
                opt.state[params[2][1]].clear()  # "bias" starts again
            for (_, p), g in zip(params, _grads(params, step)):
                p.grad = g
            opt.step()
        runs.append((params, opt))
    (a, oa), (b, ob) = runs
    assert [int(ob.state[p]["step"]) for _, p in b] == [4, 4, 2, 4]
    for (name, p), (_, q) in zip(a, b):
        assert torch.equal(oa.state[p]["first_moment_codes"], ob.state[q]["first_moment_codes"]), name
        x, y = p.detach(), q.detach()
        assert bool(((x - y).abs() <= 2 * torch.finfo(x.dtype).eps * x.abs() + 1e-6).all()), name
