"""``nonfinite="skip"`` (the default): a step whose gradients hold NaN/Inf changes nothing but its counter (case 001),
for all three optimizers; the count survives checkpoints and is shown by ``gefen inspect``. ``"raise"`` refuses
such a step (in every gradient dtype) before any change, ``"propagate"`` (old name ``"ignore"``) lets it through."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch

import gefen
from gefen import CheckpointError, StepError
from gefen.inspect import inspect_state_dict
from tests.optim.determinism_job import digest
from tests.optim.test_capturable import _cap_grads, _cap_model

KINDS = ("gefen", "muon", "hybrid_gefen", "hybrid_adamw")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))


def _build(kind: str, model: torch.nn.Module, **options) -> torch.optim.Optimizer:
    if kind == "gefen":
        return gefen.Gefen(model.named_parameters(), lr=1e-3, **options)
    if kind == "muon":
        return gefen.GefenMuon([(n, p) for n, p in model.named_parameters() if p.dim() == 2], lr=1e-3, **options)
    backup = "gefen" if kind == "hybrid_gefen" else "adamw"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the head is Linear(32, 8): no hidden matrix warnings matter here
        return gefen.GefenMuonHybrid(model, lr=1e-3, backup_optimizer=backup, **options)


def _grads(model: torch.nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    model.zero_grad()
    model(torch.randn(4, 16)).square().mean().backward()


def _without_counter(obj):
    if isinstance(obj, dict):
        return {k: _without_counter(v) for k, v in obj.items() if k != "skipped_steps"}
    if isinstance(obj, list):
        return [_without_counter(v) for v in obj]
    return obj


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bad", ["0.weight", "1.bias"])
def test_case_001_a_nan_step_changes_nothing_and_the_next_step_is_the_clean_one(kind, bad):
    """Case 001 for every optimizer; in a hybrid ``0.weight`` is in the Muon half and ``1.bias`` in the backup."""
    if kind == "muon" and bad == "1.bias":
        bad = "1.weight"
    model, clean_model = _model(), _model()
    opt, clean = _build(kind, model), _build(kind, clean_model)
    for step in range(2):
        for m, o in ((model, opt), (clean_model, clean)):
            _grads(m, step)
            o.step()
    params_before = [p.detach().clone() for p in model.parameters()]
    state_before = copy.deepcopy(opt.state_dict())
    _grads(model, 99)
    dict(model.named_parameters())[bad].grad.view(-1)[3] = float("nan")
    with pytest.warns(UserWarning, match=rf"skipped this step because the gradients of {bad} hold NaN/Inf"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params_before))
    state_after = opt.state_dict()
    assert _equal(_without_counter(state_after), _without_counter(state_before))
    assert opt.skipped_steps == 1 and clean.skipped_steps == 0
    for m, o in ((model, opt), (clean_model, clean)):
        _grads(m, 7)
        o.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), clean_model.parameters()))
    assert _equal(_without_counter(opt.state_dict()), _without_counter(clean.state_dict()))
    assert not any(torch.isnan(p).any() for p in model.parameters())


@pytest.mark.parametrize("kind", KINDS)
def test_an_infinite_first_gradient_skips_without_learning_anything(kind):
    model = _model()
    opt = _build(kind, model)
    _grads(model, 0)
    model[0].weight.grad[0, 0] = float("inf")
    with pytest.warns(UserWarning, match="skipped this step"):
        opt.step()
    children = opt._children() if isinstance(opt, gefen.GefenMuonHybrid) else [opt]
    assert all(len(c.state) == 0 for c in children)
    assert all(getattr(c, "codebook", None) is None for c in children)
    assert opt.skipped_steps == 1


@pytest.mark.parametrize("kind", KINDS)
def test_skipped_steps_survive_a_checkpoint_and_inspect_shows_them(kind):
    model = _model()
    opt = _build(kind, model)
    for step in range(3):
        _grads(model, step)
        if step == 1:
            model[1].bias.grad[0] = float("nan") if kind != "muon" else 0.0
            model[1].weight.grad[0, 0] = float("nan")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()
    assert opt.skipped_steps == 1
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    fresh = _build(kind, _model())
    fresh.load_state_dict(saved)
    assert fresh.skipped_steps == 1
    report = inspect_state_dict(saved)
    assert not report.all_problems
    if kind.startswith("hybrid"):
        assert report.skipped_steps == 1
    else:
        assert [h.skipped_steps for h in report.halves] == [1]


def test_a_schema_2_checkpoint_migrates_with_no_skipped_steps():
    model = _model()
    opt = _build("gefen", model)
    _grads(model, 0)
    opt.step()
    sd = opt.state_dict()
    old = {k: v for k, v in sd["gefen"].items() if k != "skipped_steps"}
    old["schema_version"] = 2
    sd["gefen"] = old
    for group in sd["param_groups"]:
        group["gefen_metadata"] = old
    fresh = _build("gefen", _model())
    fresh._skipped_steps = 5
    fresh.load_state_dict(sd)
    assert fresh.skipped_steps == 0 and fresh.global_step == 1


@pytest.mark.parametrize("value", [-1, 1.5, "2"])
def test_a_bad_skipped_step_count_is_refused(value):
    model = _model()
    opt = _build("gefen", model)
    _grads(model, 0)
    opt.step()
    sd = opt.state_dict()
    sd["gefen"] = {**sd["gefen"], "skipped_steps": value}
    for group in sd["param_groups"]:
        group["gefen_metadata"] = sd["gefen"]
    with pytest.raises(CheckpointError, match="skipped_steps"):
        _build("gefen", _model()).load_state_dict(sd)


def test_raise_and_deterministic_refuse_and_propagate_poisons():
    for options, expect in (
        ({"nonfinite": "raise"}, "raise"),
        ({"deterministic": True}, "raise"),
        ({"deterministic": True, "nonfinite": "skip"}, "skip"),
        ({"nonfinite": "propagate"}, "nan"),
    ):
        model = _model()
        opt = _build("gefen", model, **options)
        _grads(model, 0)
        opt.step()
        _grads(model, 1)
        model[1].bias.grad[0] = float("nan")
        if expect == "raise":
            with pytest.raises(gefen.StepError, match="1.bias has NaN/Inf"):
                opt.step()
        elif expect == "skip":
            with pytest.warns(UserWarning, match="skipped"):
                opt.step()
            assert opt.skipped_steps == 1
        else:
            opt.step()
            assert torch.isnan(model[1].bias).any() and opt.skipped_steps == 0


def test_gradscaler_overflow_is_not_counted_as_a_skipped_step():
    """GradScaler's own skip (fp16 gradients, the optimizer-side protocol) stays the scaler's: not counted."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8).half()
    opt = gefen.Gefen(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.randn(4, 16).half()).float().square().mean()).backward()
    model.weight.grad[0, 0] = float("inf")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler.step(opt)
    assert opt.skipped_steps == 0 and opt.global_step == 0


@pytest.mark.skipif(not gefen.kernels.native.native_status().available, reason="needs the native library")
@pytest.mark.parametrize("policy", ["skip", "raise"])
@pytest.mark.parametrize("value", ["nan", "inf", "above_bound"])
def test_the_native_step_applies_the_policy_itself_with_no_gradient_read_before_it(monkeypatch, policy, value):
    """On a steady CPU step the check runs inside the native call (between its statistics pass and its first
    write): the preflight reads no gradient, and the call refuses the same gradients the eager check would (NaN, Inf,
    a finite value beyond :func:`gefen.amp.usable_bound`) with nothing changed, for a factored and a block moment."""
    import gefen.optim._base as base

    model = _model()  # 0.weight (32, 16): factored; 0.bias (32,): block moment
    opt = gefen.Gefen(model.named_parameters(), lr=1e-3, nonfinite=policy)
    for step in range(2):
        _grads(model, step)
        opt.step()
    reads = []
    monkeypatch.setattr(base, "unusable_names", lambda named: reads.append(len(named)) or [])
    for bad in ("0.weight", "0.bias"):
        _grads(model, 5)
        opt.step()  # a clean step: applied, no preflight read
        grad = dict(model.named_parameters())[bad].grad
        bound = gefen.kernels.native.as_float32(gefen.amp.usable_bound(grad.numel()))
        grad.view(-1)[-1] = {"nan": float("nan"), "inf": float("inf"), "above_bound": 1.0000001 * bound}[value]
        assert 1.0000001 * bound < 1.8446742e19 or value != "above_bound"  # finite square: only the bound refuses
        params_before = [p.detach().clone() for p in model.parameters()]
        state_before = copy.deepcopy(opt.state_dict())
        if policy == "skip":
            with pytest.warns(UserWarning, match=rf"skipped this step because the gradients of {bad} hold"):
                opt.step()
        else:
            with pytest.raises(gefen.StepError, match=rf"the gradient of {bad} has NaN/Inf values"):
                opt.step()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params_before))
        assert _equal(_without_counter(opt.state_dict()), _without_counter(state_before))
    assert reads == []
    assert opt.skipped_steps == (2 if policy == "skip" else 0)


@pytest.mark.skipif(not gefen.kernels.native.native_status().available, reason="needs the native library")
@pytest.mark.parametrize("policy", ["skip", "raise"])
@pytest.mark.parametrize("value", ["nan", "inf", "above_bound"])
def test_the_first_step_checks_its_gradients_in_the_histogram_with_no_read_before_it(monkeypatch, policy, value):
    """A first CPU step leaves the check of its fp32 gradients to the codebook histogram (which reads them anyway)
    and to the period search before it: the preflight reads none of them, and the step refuses the same gradients
    the preflight would (NaN, Inf, a finite value beyond :func:`gefen.amp.usable_bound`), naming them in step order,
    with nothing learned or changed; the next clean step is the first step of a fresh optimizer."""
    import gefen.optim._base as base

    reads = []
    checked = base.unusable_names
    monkeypatch.setattr(base, "unusable_names", lambda named: reads.append([n for n, _ in named]) or checked(named))
    for bad in (["0.weight"], ["0.bias"], ["1.weight", "1.bias"]):  # searched, per-element blocks, two of them
        model, clean_model = _model(), _model()
        opt = gefen.Gefen(model.named_parameters(), lr=1e-3, nonfinite=policy)
        clean = gefen.Gefen(clean_model.named_parameters(), lr=1e-3, nonfinite=policy)
        _grads(model, 3)
        for name in bad:
            grad = dict(model.named_parameters())[name].grad
            bound = gefen.kernels.native.as_float32(gefen.amp.usable_bound(grad.numel()))
            grad.view(-1)[-1] = {"nan": float("nan"), "inf": float("inf"), "above_bound": 1.0000001 * bound}[value]
        params_before = [p.detach().clone() for p in model.parameters()]
        if policy == "skip":
            with pytest.warns(UserWarning, match=rf"skipped this step because the gradients of {', '.join(bad)} hold"):
                opt.step()
            assert opt.skipped_steps == 1
        else:
            with pytest.raises(gefen.StepError, match=rf"the gradient of {bad[0]} has NaN/Inf values"):
                opt.step()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params_before))
        assert len(opt.state) == 0 and opt.codebook is None
        for m, o in ((model, opt), (clean_model, clean)):
            _grads(m, 4)
            o.step()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), clean_model.parameters()))
        assert torch.equal(opt.codebook, clean.codebook)
    assert reads == [[]] * 9  # three refused first steps and six clean ones: no gradient read by the preflight


def test_a_first_step_in_bf16_or_with_a_codebook_is_still_checked_by_the_preflight(monkeypatch):
    """The histogram checks only contiguous fp32 CPU gradients while the codebook is to be learned: a bf16
    gradient, or a parameter starting after the codebook was learned, is read by the preflight as before."""
    import gefen.optim._base as base

    reads = []
    checked = base.unusable_names
    monkeypatch.setattr(base, "unusable_names", lambda named: reads.append([n for n, _ in named]) or checked(named))
    model = _model()
    opt = gefen.Gefen([model[0].weight], lr=1e-3)
    _grads(model, 0)
    opt.step()
    opt.add_param_group({"params": [model[1].weight]})
    _grads(model, 1)
    model[1].weight.grad[0, 0] = float("nan")
    with pytest.warns(UserWarning, match="skipped this step because the gradients of "):
        opt.step()
    assert reads == [[], ["param_groups[0][0]", "param_groups[1][0]"]]  # the first step: nothing; then both
    assert model[1].weight not in opt.state or len(opt.state[model[1].weight]) == 0
    bf16 = torch.nn.Linear(8, 8).to(torch.bfloat16)
    opt = gefen.Gefen(bf16.parameters(), lr=1e-3)
    bf16(torch.randn(2, 8, dtype=torch.bfloat16)).float().square().mean().backward()
    opt.step()
    assert reads[-1] == ["param_groups[0][0]", "param_groups[0][1]"]


def test_nonfinite_raise_refuses_a_nan_step_and_propagate_lets_it_through():
    for policy, raises in (("raise", True), ("propagate", False)):
        m = _cap_model()
        opt = gefen.Gefen(m.named_parameters(), nonfinite=policy, fused=False)
        _cap_grads(m, 0)
        opt.step()
        _cap_grads(m, 1)
        m[1].weight.grad[0, 0] = float("nan")
        before = digest([m.state_dict(), opt.state_dict()])
        if raises:
            with pytest.raises(StepError, match="1.weight.*NaN/Inf"):
                opt.step()
            assert digest([m.state_dict(), opt.state_dict()]) == before
        else:
            opt.step()
            assert torch.isnan(m[1].weight).any()


def test_ignore_is_the_old_name_of_propagate():
    m = _cap_model()
    with pytest.warns(FutureWarning, match="old name of nonfinite='propagate'"):
        opt = gefen.Gefen(m.parameters(), nonfinite="ignore")
    assert opt.nonfinite == "propagate"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bad", [float("inf"), -float("inf"), float("nan")])
def test_nonfinite_raise_refuses_infinities_in_every_gradient_dtype(dtype, bad):
    """A float16 infinity once passed the check: ``max|g| <= bound`` compared in float16, where the bound itself
    rounds to inf."""
    p = torch.nn.Parameter(torch.randn(64, 32).to(dtype))
    opt = gefen.Gefen([p], nonfinite="raise")
    p.grad = torch.randn(64, 32).to(dtype)
    opt.step()
    p.grad = torch.randn(64, 32).to(dtype)
    p.grad[5, 7] = bad
    before = digest([p.detach().clone(), opt.state_dict()])
    with pytest.raises(StepError, match="NaN/Inf"):
        opt.step()
    assert digest([p.detach().clone(), opt.state_dict()]) == before


class _NotYet:
    """Stands in for a CUDA event: the flags are read only when the host settles the step."""

    def __init__(self) -> None:
        self.waited = 0

    def query(self) -> bool:
        return False  # not yet arrived: a step that needs the host counters must wait (synchronize) for it

    def synchronize(self) -> None:
        self.waited += 1


@pytest.mark.slow  # compiles the kernels
@pytest.mark.parametrize("lagged", [False, True])
def test_the_compiled_step_decides_a_skip_on_the_device_with_no_host_read(monkeypatch, lagged):
    """``backend="compiled"`` (CUDA's default) under ``"skip"``: no gradient is read on the host; the usability
    flags mask every kernel write (:data:`gefen.kernels.fused.APPLY`). On the CPU the step settles at once; on CUDA
    (``lagged``, forced here with a stand-in event) the host settles it when it next looks: before that the step
    counters, ``global_step`` and ``skipped_steps`` have not moved, after it they say what happened, and either way
    the state and the next step are those of an optimizer that never saw the bad gradient."""
    import gefen.optim._base as base
    import gefen.optim.gefen as gefen_module
    from gefen.nonfinite import PendingCheck

    events = []
    if lagged:

        def of(flags, names, counters):
            events.append(_NotYet())
            return PendingCheck(flags, tuple(names), counters, events[-1])

        monkeypatch.setattr(PendingCheck, "of", staticmethod(of))
    model, clean_model = _model(), _model()
    opt = gefen.Gefen(model.named_parameters(), lr=1e-3, backend="compiled")
    clean = gefen.Gefen(clean_model.named_parameters(), lr=1e-3, backend="compiled")
    for step in range(2):
        for m, o in ((model, opt), (clean_model, clean)):
            _grads(m, step)
            o.step()
    reads = []
    for module in (base, gefen_module):
        monkeypatch.setattr(module, "unusable_names", lambda named: reads.append(len(named)) or [])
    params_before = [p.detach().clone() for p in model.parameters()]
    state_before = copy.deepcopy(opt.state_dict())
    _grads(model, 99)
    model[0].weight.grad[3, 1] = float("nan")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
        if lagged:  # nothing settled yet: no warning, no count, no counter moved
            assert not caught and opt._skipped_steps == 0 and opt._global_step == 2
            assert all(int(s["step"]) == 2 for s in opt.state.values())
        assert opt.skipped_steps == 1  # looking settles it
    assert [str(w.message) for w in caught if "skipped this step" in str(w.message)]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params_before))
    assert _equal(_without_counter(opt.state_dict()), _without_counter(state_before))
    assert opt.global_step == 2
    for m, o in ((model, opt), (clean_model, clean)):
        _grads(m, 7)
        o.step()
    assert opt.global_step == clean.global_step == 3  # the applied step settles at the next look
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), clean_model.parameters()))
    assert _equal(_without_counter(opt.state_dict()), _without_counter(clean.state_dict()))
    assert reads == []
    if lagged:  # both optimizers' steady steps: the second warm-up step, the NaN step, the last step
        assert len(events) == 5 and all(e.waited == 1 for e in events)


@pytest.mark.slow  # compiles the kernels
def test_the_compiled_step_under_raise_refuses_before_any_write_and_a_pending_skip_settles_on_load(monkeypatch):
    """``"raise"`` needs its answer in the step: the compiled path reads the flags on the host there (StepError,
    nothing changed). A step still pending when a checkpoint is loaded is settled first (counted and warned about
    as the old state's), and the load then wins."""
    from gefen.nonfinite import PendingCheck

    model = _model()
    strict = gefen.Gefen(model.named_parameters(), lr=1e-3, backend="compiled", nonfinite="raise")
    for step in range(2):
        _grads(model, step)
        strict.step()
    before = [p.detach().clone() for p in model.parameters()]
    _grads(model, 3)
    model[1].bias.grad[0] = float("inf")
    with pytest.raises(gefen.StepError, match="the gradient of 1.bias has NaN/Inf values"):
        strict.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))

    monkeypatch.setattr(PendingCheck, "of", staticmethod(lambda f, n, c: PendingCheck(f, tuple(n), c, _NotYet())))
    model = _model()
    opt = gefen.Gefen(model.named_parameters(), lr=1e-3, backend="compiled")
    for step in range(2):
        _grads(model, step)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    _grads(model, 3)
    model[1].bias.grad[0] = float("nan")
    opt.step()  # pending
    with pytest.warns(UserWarning, match="skipped this step because the gradients of 1.bias"):
        opt.load_state_dict(saved)
    assert opt.skipped_steps == 0 and opt.global_step == 2  # the checkpoint's counts
    assert _equal(opt.state_dict(), saved)
