"""Checkpoints (``gefen.checkpoint``): bit-exact resume, the saved layout and its metadata (every copy of it),
saved dtypes surviving bf16 params, weights_only loading of every parameter shape, refused loads (a
``CheckpointError``) that leave the optimizer and the caller's dict untouched, and the migration of schema-1
checkpoints (committed fixtures). The hybrid's layout is in ``test_checkpoint_hybrid.py``."""

from __future__ import annotations

import copy
import io
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gefen
from gefen import CheckpointError, ConfigError, StepError
from gefen.checkpoint import GROUP_METADATA_KEY, METADATA_KEY, SCHEMA_VERSION
from gefen.checkpoint_hybrid import split_hybrid_state_dict
from gefen.digest import state_digest

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _model(dtype=torch.float32, seed=0, hidden=48):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Embedding(64, 32),
        torch.nn.Linear(32, hidden),
        torch.nn.GELU(),
        torch.nn.LayerNorm(hidden),
        torch.nn.Linear(hidden, 64),
    )
    return model.to(dtype)


def _train(model, opt, steps, offset=0):
    for s in range(steps):
        gen = torch.Generator().manual_seed(offset + s)
        tokens = torch.randint(0, 64, (4, 12), generator=gen)
        logits = model(tokens).float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), tokens.roll(1, 1).reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()


def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# ---------------------------------------------------------------------------------------------- resume and layout
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("factored", [True, False])
def test_resume_is_bit_exact(dtype, factored):
    model_a = _model(dtype)
    opt_a = gefen.Gefen(model_a.named_parameters(), lr=3e-3, weight_decay=0.1, factored_v_2d=factored)
    _train(model_a, opt_a, 3)
    saved_model = _roundtrip(model_a.state_dict())
    saved_opt = _roundtrip(opt_a.state_dict())
    _train(model_a, opt_a, 4, offset=3)

    model_b = _model(dtype, seed=123)
    model_b.load_state_dict(saved_model)
    opt_b = gefen.Gefen(model_b.named_parameters(), lr=3e-3, weight_decay=0.1, factored_v_2d=factored)
    opt_b.load_state_dict(saved_opt)
    _train(model_b, opt_b, 4, offset=3)

    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(a, b), name
    for p_a, p_b in zip(model_a.parameters(), model_b.parameters()):
        for key, value in opt_a.state[p_a].items():
            assert torch.equal(value, opt_b.state[p_b][key]), key
    assert torch.equal(opt_a.codebook, opt_b.codebook) and opt_a.global_step == opt_b.global_step == 7


def test_saved_dtypes_survive_load_into_bf16_params():
    model = _model(torch.bfloat16)
    opt = gefen.Gefen(model.parameters(), lr=1e-3)
    _train(model, opt, 2)
    opt2 = gefen.Gefen(model.parameters(), lr=1e-3)
    opt2.load_state_dict(_roundtrip(opt.state_dict()))
    for p in model.parameters():
        st = opt2.state[p]
        assert st["first_moment_codes"].dtype == torch.uint8
        assert st["first_moment_scale"].dtype == torch.float32
        assert st["step"].dtype == torch.int64 and st["period"].dtype == torch.int64
        moments = [k for k in st if k.startswith("second_moment")]
        assert moments and all(st[k].dtype == torch.float32 for k in moments)
    assert opt2.codebook.dtype == torch.float32


def test_state_dict_layout_and_metadata():
    model = _model()
    opt = gefen.Gefen(model.named_parameters(), lr=1e-3)
    sd = opt.state_dict()
    # before the first step: no codebook entry (DCP's full-state merge would keep a live None over a saved one) and
    # zero counters standing in for every parameter's state (DCP can only merge 0-dim entries the live dict has)
    assert sd[METADATA_KEY]["schema_version"] == SCHEMA_VERSION and "codebook" not in sd[METADATA_KEY]
    zero = {"step": torch.tensor(0), "period": torch.tensor(0)}
    assert sd["state"].keys() == set(range(len(list(model.parameters()))))
    assert all(st == zero for st in sd["state"].values())
    _train(model, opt, 1)
    sd = opt.state_dict()
    meta = sd[METADATA_KEY]
    assert meta["optimizer"] == "Gefen" and meta["global_step"] == 1
    assert meta["codebook"].shape == (256,) and meta["codebook"].dtype == torch.float32
    assert isinstance(meta["period_search"], str)
    assert set(sd["state"]) == set(range(len(list(model.parameters()))))
    assert sd["param_groups"][0]["param_names"][0] == "0.weight"


def test_pristine_checkpoint_loads_and_trains_like_fresh():
    model_a, model_b = _model(), _model()
    opt_a = gefen.Gefen(model_a.parameters(), lr=1e-3)
    opt_b = gefen.Gefen(model_b.parameters(), lr=1e-3)
    opt_b.load_state_dict(_roundtrip(opt_a.state_dict()))
    _train(model_a, opt_a, 2)
    _train(model_b, opt_b, 2)
    assert all(torch.equal(a, b) for a, b in zip(model_a.parameters(), model_b.parameters()))


# ---------------------------------------------------------------------------------------------- refusals
def _inplace(mutate):
    """Wrap an in-place mutation so it returns the mutated dict."""

    def run(sd):
        mutate(sd)
        return sd

    return run


def _first(sd):
    return sd["state"][0]


BAD_LOADS = [
    ("not a dict", lambda sd: [1, 2], "must be a dict"),
    (
        "no metadata",
        lambda sd: {
            "state": sd["state"],
            "param_groups": [{k: v for k, v in g.items() if k != GROUP_METADATA_KEY} for g in sd["param_groups"]],
        },
        "not a Gefen checkpoint",
    ),
    (
        "newer schema",
        _inplace(lambda sd: sd[METADATA_KEY].update(schema_version=SCHEMA_VERSION + 1)),
        "newer",
    ),
    ("other optimizer", _inplace(lambda sd: sd[METADATA_KEY].update(optimizer="GefenMuon")), "GefenMuon"),
    (
        "unknown period search",
        _inplace(lambda sd: sd[METADATA_KEY].update(period_search="other")),
        "period_search",
    ),
    ("codebook missing", _inplace(lambda sd: sd[METADATA_KEY].update(codebook=None)), "no frozen codebook"),
    (
        "codebook short",
        _inplace(lambda sd: sd[METADATA_KEY].update(codebook=torch.linspace(-1, 1, 255))),
        "codebook",
    ),
    ("codebook unsorted", _inplace(lambda sd: sd[METADATA_KEY]["codebook"].__setitem__(5, 0.9)), "codebook"),
    (
        "group count",
        _inplace(lambda sd: sd["param_groups"].append(copy.deepcopy(sd["param_groups"][0]))),
        "param groups",
    ),
    ("param count", _inplace(lambda sd: sd["param_groups"][0]["params"].pop()), "parameters"),
    (
        "a name not a string",
        _inplace(lambda sd: sd["param_groups"][0]["param_names"].__setitem__(0, 3)),
        "param_names",
    ),
    (
        "codes dtype",
        _inplace(lambda sd: _first(sd).update(first_moment_codes=_first(sd)["first_moment_codes"].float())),
        "dtype",
    ),
    (
        "scale dtype",
        _inplace(lambda sd: _first(sd).update(first_moment_scale=_first(sd)["first_moment_scale"].bfloat16())),
        "dtype",
    ),
    (
        "scale negative",
        _inplace(lambda sd: _first(sd)["first_moment_scale"].__setitem__(0, -1.0)),
        "negative",
    ),
    (
        "second moment nan",
        _inplace(lambda sd: _first(sd)["second_moment_row"].__setitem__(0, float("nan"))),
        "non-finite",
    ),
    (
        "period does not divide",
        _inplace(lambda sd: _first(sd).update(period=torch.tensor(7))),
        "does not divide",
    ),
    ("step zero", _inplace(lambda sd: _first(sd).update(step=torch.tensor(0))), "step"),
    ("step float", _inplace(lambda sd: _first(sd).update(step=torch.tensor(2.0))), "int64"),
    ("missing key", _inplace(lambda sd: _first(sd).pop("second_moment_col")), "keys"),
    ("unknown key", _inplace(lambda sd: _first(sd).update(extra=torch.zeros(1))), "keys"),
    ("unknown param index", _inplace(lambda sd: sd["state"].update({99: _first(sd)})), "99"),
    ("bad eps", _inplace(lambda sd: sd["param_groups"][0].update(eps=0.0)), "eps"),
    ("bad betas", _inplace(lambda sd: sd["param_groups"][0].update(betas=(0.9, 1.0))), "betas"),
    ("bad lr", _inplace(lambda sd: sd["param_groups"][0].update(lr=float("nan"))), "lr"),
]


@pytest.mark.parametrize(("case", "mutate", "pattern"), BAD_LOADS, ids=[c[0] for c in BAD_LOADS])
def test_refused_loads_change_nothing(case, mutate, pattern):
    model = _model()
    opt = gefen.Gefen(model.named_parameters(), lr=1e-3)
    _train(model, opt, 2)
    good = _roundtrip(opt.state_dict())
    bad = _roundtrip(opt.state_dict())
    bad = mutate(bad)
    frozen = copy.deepcopy(bad)

    control_model = _model()
    control_model.load_state_dict(model.state_dict())
    control = gefen.Gefen(control_model.named_parameters(), lr=1e-3)
    control.load_state_dict(good)

    groups_before = opt.param_groups
    with pytest.raises(CheckpointError, match=pattern):
        opt.load_state_dict(bad)
    assert opt.param_groups is groups_before
    # the caller's dict is untouched
    if isinstance(bad, dict):
        assert bad.keys() == frozen.keys()
        assert str(bad) == str(frozen)
    # a later step continues exactly like a control that never saw the bad checkpoint
    _train(model, opt, 2, offset=10)
    _train(control_model, control, 2, offset=10)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), control_model.parameters()))


def test_load_refuses_other_shapes():
    model = _model()
    opt = gefen.Gefen(model.parameters(), lr=1e-3)
    _train(model, opt, 1)
    sd = _roundtrip(opt.state_dict())
    other = _model(hidden=40)
    opt2 = gefen.Gefen(other.parameters(), lr=1e-3)
    with pytest.raises(CheckpointError, match="belongs to another model|expected"):
        opt2.load_state_dict(sd)
    assert len(opt2.state) == 0 and opt2.codebook is None


def test_load_refuses_block_state_into_other_second_moment_kind():
    model = _model()
    opt = gefen.Gefen(model.parameters(), lr=1e-3, factored_v_2d=False)
    _train(model, opt, 1)
    sd = _roundtrip(opt.state_dict())
    sd["param_groups"][0]["factored_v_2d"] = True  # metadata says factored, state says block
    opt2 = gefen.Gefen(model.parameters(), lr=1e-3)
    with pytest.raises(CheckpointError, match="factored_v_2d"):
        opt2.load_state_dict(sd)


def test_load_hooks_run_pre_then_post_only_on_success():
    model = _model()
    opt = gefen.Gefen(model.parameters(), lr=1e-3)
    _train(model, opt, 1)
    sd = opt.state_dict()
    calls = []
    opt.register_load_state_dict_pre_hook(lambda o, s: calls.append("pre"))
    opt.register_load_state_dict_post_hook(lambda o: calls.append("post"))
    bad = dict(sd)
    bad[METADATA_KEY] = dict(sd[METADATA_KEY], schema_version=99)
    with pytest.raises(CheckpointError):
        opt.load_state_dict(bad)
    assert calls == ["pre"]
    opt.load_state_dict(sd)
    assert calls == ["pre", "pre", "post"]


# ---------------------------------------------------------------------------------------------- every shape
#: Every shape class the optimizers step (case 004: a 0-D parameter made the optimizer's own checkpoint unloadable)
ROUND_TRIP_SHAPES = [(), (1,), (1, 1), (7,), (13, 17), (1, 9), (9, 1), (3, 1, 5), (2, 3, 4, 5), (64, 48), (0,), (0, 4)]


def _shape_params(shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(f"p{i}", torch.nn.Parameter(torch.randn(s, generator=gen) * 1e-2)) for i, s in enumerate(shapes)]


def _shape_grads(named, step):
    gen = torch.Generator().manual_seed(1000 + step)
    for _, p in named:
        p.grad = torch.randn(p.shape, generator=gen) * torch.rand((), generator=gen)


def _shape_optimizer(kind, named):
    if kind == "gefen":
        return gefen.Gefen(named, lr=1e-2, weight_decay=0.1)
    if kind == "muon":  # GefenMuon steps 2-D matrices only
        return gefen.GefenMuon([(n, p) for n, p in named if p.ndim == 2], lr=1e-2)
    return gefen.GefenMuonHybrid(named, lr=1e-2, backup_lr=1e-2)


@pytest.mark.filterwarnings("ignore:Gefen learned its codebook:UserWarning")
@pytest.mark.filterwarnings("ignore:GefenMuonHybrid:UserWarning")
@pytest.mark.parametrize("kind", ["gefen", "muon", "hybrid"])
def test_every_shape_round_trips_through_torch_save(kind):
    """0-D, size-1 dimensions, N-D, primes and empty parameters: state_dict -> torch.save -> torch.load(weights_only)
    -> load_state_dict into a fresh optimizer, then both continue bit-identically."""
    named_a = _shape_params(ROUND_TRIP_SHAPES)
    opt_a = _shape_optimizer(kind, named_a)
    for s in range(2):
        _shape_grads(named_a, s)
        opt_a.step()
    saved_params = [p.detach().clone() for _, p in named_a]
    saved = _roundtrip(opt_a.state_dict())
    named_b = [(n, torch.nn.Parameter(v.clone())) for (n, _), v in zip(named_a, saved_params)]
    opt_b = _shape_optimizer(kind, named_b)
    opt_b.load_state_dict(saved)
    for s in range(2, 4):
        for named in (named_a, named_b):
            _shape_grads(named, s)
        opt_a.step()
        opt_b.step()
    for (name, a), (_, b) in zip(named_a, named_b):
        assert torch.equal(a, b), name
    assert state_digest(opt_a.state_dict()) == state_digest(opt_b.state_dict())


def test_zero_dim_parameter_checkpoint_loads_case_004():
    """../shared/cases/004: a learnable scalar next to a matrix and a vector; the raw IndexError is gone."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s) * 1e-3) for s in [(16, 8), (), (7,)]]
    opt = gefen.Gefen(params, lr=1e-2)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape)
        opt.step()
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = gefen.Gefen(twin, lr=1e-2)
    opt2.load_state_dict(_roundtrip(opt.state_dict()))
    assert int(opt2.state[twin[1]]["step"]) == 2 and int(opt2.state[twin[1]]["period"]) == 1
    for p, q in zip(params, twin):
        g = torch.randn(p.shape)
        p.grad, q.grad = g, g.clone()
    opt.step()
    opt2.step()
    assert all(torch.equal(p, q) for p, q in zip(params, twin))


_MALFORMED = [None, 1, -1, 3.5, "x", [], {}, [1, 2], float("nan"), torch.zeros(()), torch.zeros(3), torch.zeros(0)]
_MALFORMED += [torch.zeros(2, 2, dtype=torch.float64), torch.tensor(-5), torch.zeros(5, dtype=torch.uint8)]


def _paths(obj, path=()):
    """Every (path, value) of a nested state dict, containers included."""
    yield path, obj
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _paths(value, (*path, key))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            yield from _paths(value, (*path, i))


@pytest.fixture(scope="module")
def _checkpoints():
    """A real checkpoint (torch.save round trip) of each optimizer over every shape class, after two steps."""
    import warnings

    saved = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for kind in ("gefen", "muon", "hybrid"):
            named = _shape_params(ROUND_TRIP_SHAPES)
            opt = _shape_optimizer(kind, named)
            for s in range(2):
                _shape_grads(named, s)
                opt.step()
            saved[kind] = _roundtrip(opt.state_dict())
    return saved


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("kind", ["gefen", "muon", "hybrid"])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_malformed_checkpoints_get_a_checkpoint_error(kind, data, _checkpoints):
    """Any one structural mutation of a real checkpoint (a key removed, renamed or added, a value replaced by
    another type, shape or dtype) either loads or raises CheckpointError (never a raw IndexError, KeyError,
    TypeError, ...), and a refused load changes nothing."""
    checkpoint = copy.deepcopy(_checkpoints[kind])
    paths = [p for p, _ in _paths(checkpoint) if p]
    path = data.draw(st.sampled_from(paths), label="path")
    parent = checkpoint
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    action = data.draw(st.sampled_from(["remove", "replace", "add", "rename"]), label="action")
    bad = copy.deepcopy(data.draw(st.sampled_from(_MALFORMED), label="value"))
    if action == "remove" or (action == "rename" and isinstance(parent, list)):
        parent.pop(key)
    elif action == "replace":
        parent[key] = bad
    elif action == "add":
        if isinstance(parent, list):
            parent.append(bad)
        else:
            parent[data.draw(st.sampled_from(["zzz", 999, -1, "step", "0"]), label="new key")] = bad
    else:
        parent[data.draw(st.sampled_from([f"{key}x", 12345, -3, "0"]), label="new name")] = parent.pop(key)
    named = _shape_params(ROUND_TRIP_SHAPES)
    opt = _shape_optimizer(kind, named)
    before = state_digest(opt.state_dict())
    try:
        opt.load_state_dict(checkpoint)
    except CheckpointError:
        assert state_digest(opt.state_dict()) == before


# ---------------------------------------------------------------------------------------------- metadata
def test_deterministic_policy_is_in_every_metadata_copy_and_refused_across_policies():
    model = torch.nn.Linear(8, 16)
    opt = gefen.Gefen(model.named_parameters(), deterministic=True, fused=False)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    assert sd["gefen"]["deterministic"] is True
    assert all(g["gefen_metadata"]["deterministic"] is True for g in sd["param_groups"])
    other = gefen.Gefen(torch.nn.Linear(8, 16).named_parameters(), fused=False)
    with pytest.raises(gefen.CheckpointError, match="deterministic=True.*deterministic=False"):
        other.load_state_dict(sd)
    assert other.codebook is None and len(other.state) == 0


def test_dcp_style_checkpoint_with_only_state_and_param_groups_resumes_exactly():
    """``get_optimizer_state_dict``-style tools keep only ``state`` and ``param_groups``: the per-group mirror
    carries the codebook and the policy, and the loaded optimizer continues bit for bit."""

    def setup():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 8))
        return m, gefen.Gefen(m.named_parameters(), lr=1e-2, fused=False)

    def train(m, opt, steps):
        for s in steps:
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(s))
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()

    whole_m, whole = setup()
    train(whole_m, whole, range(4))
    m, opt = setup()
    train(m, opt, range(2))
    stripped = copy.deepcopy({"state": opt.state_dict()["state"], "param_groups": opt.state_dict()["param_groups"]})
    m2, opt2 = setup()
    m2.load_state_dict(m.state_dict())
    opt2.load_state_dict(stripped)
    assert opt2.param_groups[0]["gefen_metadata"] is None  # the live stand-in, never the saved mirror
    train(m2, opt2, range(2, 4))
    assert all(torch.equal(a, b) for a, b in zip(m2.parameters(), whole_m.parameters()))
    assert opt2.global_step == whole.global_step == 4


def test_state_dict_post_hooks_see_the_metadata():
    model = _model()
    opt = gefen.Gefen(model.parameters(), lr=1e-2)
    _train(model, opt, 1)
    seen = []
    opt.register_state_dict_post_hook(lambda o, sd: seen.append(METADATA_KEY in sd))
    opt.state_dict()
    assert seen == [True]


def test_load_refusals_are_checkpoint_errors_subclassing_value_error():
    assert issubclass(CheckpointError, ValueError) and issubclass(ConfigError, ValueError)
    assert issubclass(StepError, RuntimeError)


# ---------------------------------------------------------------------------------------------- migration
def _fixture_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 64), torch.nn.Linear(64, 16))


def _fixture_optimizer(kind: str, model: torch.nn.Module, deterministic: bool) -> torch.optim.Optimizer:
    named = list(model.named_parameters())
    if kind == "gefen":
        return gefen.Gefen(named, lr=1e-2, weight_decay=0.01, fused=False, deterministic=deterministic)
    if kind == "gefen_block":
        return gefen.Gefen(named, lr=1e-2, factored_v_2d=False, fused=False, deterministic=deterministic)
    if kind == "gefen_muon":
        hidden = [(n, p) for n, p in named if p.dim() == 2 and n.startswith("1")]
        return gefen.GefenMuon(hidden, lr=1e-2, fused=False, deterministic=deterministic)
    backup = "gefen" if kind == "hybrid_gefen" else "adamw"
    return gefen.GefenMuonHybrid(model, lr=1e-2, backup_optimizer=backup, fused=False, deterministic=deterministic)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("kind", ["gefen", "gefen_block", "gefen_muon", "hybrid_gefen", "hybrid_adamw"])
def test_schema_v1_fixture_migrates_and_continues_like_the_v1_code(kind, deterministic):
    """``tests/fixtures/v1_*.pt`` were written by the schema-1 code (``scripts/make_v1_fixtures.py``), together
    with the parameters that code produced on the next step; an untagged v1 checkpoint loads under either live
    policy and the next step matches the v1 code's.

    "Matches" is up to float32 rounding, not bit for bit: the stored continuation comes from the machine that wrote
    the fixture, and vectorised sums (the factored second moment's row/column sums, torch's AdamW kernels) round
    differently on CPUs with other SIMD widths (measured: 1-34 elements of a tensor differ by <= 1.5e-8 on an
    AVX-512 machine against a fixture written elsewhere). A migration fault (a lost first moment, a wrong
    counter, a codebook left behind) changes the step by the size of the update itself, 1e-2 here; the bound
    below is 1e-5 of that. Matrices stepped through Newton–Schulz are bf16 products, and a bf16 GEMM's fp32 sums
    run in another order on a CPU without bf16 matrix instructions (and on another GPU), flipping the rounding of
    a few elements by one bf16 ulp (measured on the GefenMuon fixture: 6.2e-4 of the update at most, 7e-5 in
    Frobenius norm); their bound is one bf16 ulp of the update, 2⁻⁸ — still 250x below a migration fault."""
    fixture = torch.load(FIXTURES / f"v1_{kind}.pt", weights_only=True)
    saved = fixture["optimizer"]
    halves = [saved["muon"], saved["backup"]] if kind.startswith("hybrid") else [saved]
    assert all(h is None or "gefen" not in h or h["gefen"]["schema_version"] == 1 for h in halves)
    model = _fixture_model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(fixture["params"][name])
    opt = _fixture_optimizer(kind, model, deterministic)
    opt.load_state_dict(saved)
    for name, p in model.named_parameters():
        p.grad = fixture["grads"][name].clone()
    opt.step()
    through_ns = {id(p) for g in opt.param_groups if "ns_schedule" in g for p in g["params"]}
    moved = 0
    for name, p in model.named_parameters():
        expected, before = fixture["expected_after"][name], fixture["params"][name]
        update = float((expected - before).abs().max())
        if update == 0.0:  # not in this optimizer (GefenMuon's fixture steps one matrix): untouched, exactly
            assert torch.equal(p.detach(), before), name
            continue
        moved += 1
        assert update > 1e-3, name  # a real step, so the bound below is a real test
        bound = 2.0**-8 if id(p) in through_ns else 1e-5
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=bound * update, msg=name)
    assert moved >= 1
    resaved = opt.state_dict()
    if kind.startswith("hybrid"):  # resaved in torch's layout, each Gefen half's metadata in its groups
        split = split_hybrid_state_dict(resaved)
        groups = [h["param_groups"][0] for h in (split.muon, split.backup) if h is not None]
        metas = [g["gefen_metadata"] for g in groups if "gefen_metadata" in g]  # an AdamW backup has none
    else:
        metas = [resaved["gefen"]]
    assert metas
    for meta in metas:
        assert meta["schema_version"] == gefen.checkpoint.SCHEMA_VERSION
        assert meta["deterministic"] is deterministic


# --------------------------------------------------------------------- checkpoints saved under earlier layouts

SHORT_ROWED = [(48,), (24, 1), (16, 3)]


def _short_rowed_run(kind: str, steps: int, params: list[torch.nn.Parameter], opt: torch.optim.Optimizer) -> None:
    for s in range(steps):
        gen = torch.Generator().manual_seed(50 + s)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


def test_short_rowed_checkpoint_with_one_element_blocks_keeps_its_period(monkeypatch):
    """Before the layout rule flattened short-rowed shapes, 1-D tensors and columns had one-element blocks (period
    1; (16, 3) rows of 3). Such a checkpoint carries its period: it loads under today's rule, keeps its blocks and
    continues exactly like the optimizer that saved it (a restored period is never re-predicted)."""

    def old_rule(period: int, shape: tuple[int, ...]) -> int:  # the row rule: blocks cut to the row
        rows = shape[0]
        numel = 1
        for d in shape:
            numel *= d
        return numel // rows if (numel // rows) % period else period

    params = [torch.nn.Parameter(torch.randn(s)) for s in SHORT_ROWED]
    monkeypatch.setattr("gefen.optim._first_step.layout_period", old_rule)
    opt = gefen.Gefen(params, lr=1e-2, weight_decay=0.1)
    _short_rowed_run("gefen", 2, params, opt)
    monkeypatch.undo()
    assert [int(opt.state[p]["period"]) for p in params] == [1, 1, 3]
    saved = _roundtrip(opt.state_dict())
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = gefen.Gefen(twins, lr=1e-2, weight_decay=0.1)
    fresh.load_state_dict(saved)
    assert [int(fresh.state[p]["period"]) for p in twins] == [1, 1, 3]
    assert [row["layout"] for row in fresh.state_report()] == ["blocks (flattened: degenerate shape)"] * 3
    _short_rowed_run("gefen", 3, params, opt)
    _short_rowed_run("gefen", 3, twins, fresh)
    for a, b in zip(params, twins):
        assert torch.equal(a, b)
    assert state_digest(opt.state_dict()) == state_digest(fresh.state_dict())


def test_muon_checkpoint_with_normuon_rows_of_a_column_loads_without_them(monkeypatch):
    """NorMuon's row statistic is left out of matrices whose rows hold fewer than 8 elements (4 bytes per element
    for a column). A GefenMuon checkpoint saved with it for such a matrix loads: its momentum as saved, the NorMuon
    entries dropped (they no longer apply); its other matrices keep theirs."""
    shapes = [(24, 1), (16, 32)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    monkeypatch.setattr("gefen.state.has_row_statistics", lambda shape: True)  # the kind rule before the gate
    opt = gefen.GefenMuon(params, lr=1e-2, normuon=True)
    _short_rowed_run("muon", 2, params, opt)
    assert all("normuon_v" in opt.state[p] for p in params)
    saved = _roundtrip(opt.state_dict())
    monkeypatch.undo()
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = gefen.GefenMuon(twins, lr=1e-2, normuon=True)
    fresh.load_state_dict(saved)
    assert "normuon_v" not in fresh.state[twins[0]] and "normuon_v" in fresh.state[twins[1]]
    for key in ("first_moment_codes", "first_moment_scale", "step", "period"):
        assert torch.equal(fresh.state[twins[0]][key], opt.state[params[0]][key])
    _short_rowed_run("muon", 1, twins, fresh)  # and it steps
