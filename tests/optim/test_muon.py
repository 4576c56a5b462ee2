"""GefenMuon and GefenMuonHybrid: the step against a dense reference, routing, composition, checkpoints (Newton–Schulz,
the lr ratios and NorMuon's normalisation themselves: ``tests/math/test_newton_schulz.py``)."""

from __future__ import annotations

import copy
import io
import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import gefen
from gefen.errors import CheckpointError, ConfigError
from gefen.math.newton_schulz import newton_schulz, resolve_schedule
from gefen.optim._base import GefenOptimizer


# ---------------------------------------------------------------------------------------------- GefenMuon
def _matrix_problem(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(64, 32, generator=gen) * 0.1, torch.randn(64, 32, generator=gen)


def test_gefen_muon_step_matches_a_dense_reference() -> None:
    """One step from zero state: W <- W(1 - lr·wd) - lr·ratio·NS(β·m̂ + (1-β)·G), m̂ = (1-β)·G quantized."""
    w0, target = _matrix_problem()
    p = nn.Parameter(w0.clone())
    opt = gefen.GefenMuon([p], lr=0.02, weight_decay=0.1, ns_schedule="tuned4")
    p.grad = (p.detach() - target) * 2
    g = p.grad.clone()
    opt.step()
    state = opt.state[p]
    codes, scale = state["first_moment_codes"].long(), state["first_moment_scale"]
    m_hat = (opt.codebook[codes] * scale.unsqueeze(1)).view(64, 32)
    # the 8-bit momentum of (1 - β)·G: each element within half a codebook gap (times its block magnitude)
    half_gap = opt.codebook.diff().max() / 2
    error = (m_hat - 0.05 * g).abs().view(codes.shape)
    assert bool((error <= half_gap * scale.unsqueeze(1) * (1 + 1e-5)).all())
    u = 0.95 * m_hat + 0.05 * g
    o = newton_schulz(u, resolve_schedule("tuned4", 5), 1e-7).float()
    expected = w0 * (1 - 0.02 * 0.1) - 0.02 * math.sqrt(64 / 32) * o
    torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-6)
    assert int(state["step"]) == 1 and opt.state_report()[0]["second_moment"] == "momentum"


def test_gefen_muon_trains_and_holds_about_one_byte_per_param() -> None:
    w0, target = _matrix_problem(1)
    p = nn.Parameter(w0.clone())
    opt = gefen.GefenMuon([p], lr=0.2, weight_decay=0.0, normuon=True)
    losses = []
    for _ in range(30):
        loss = (p - target).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0]
    per_param = (opt.state_bytes() - 4 * 256) / p.numel()
    assert per_param < 1.3  # codes + block magnitudes + NorMuon rows (64 x 4 B over 2048 params)


@pytest.mark.parametrize("shape", [(16,), (2, 3, 4), (1,)])
def test_gefen_muon_refuses_non_2d_parameters_with_a_pointer_to_the_hybrid(shape: tuple[int, ...]) -> None:
    with pytest.raises(ConfigError, match="2-D.*GefenMuonHybrid"):
        gefen.GefenMuon([nn.Parameter(torch.zeros(shape))])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"momentum": 1.0},
        {"momentum": -0.1},
        {"eps": 0.0},
        {"lr": -1.0},
        {"weight_decay": float("nan")},
        {"adjust_lr_fn": "adam"},
        {"ns_schedule": "tuned9"},
        {"ns_steps": 0},
        {"ns_steps": 0, "ns_schedule": "tuned3"},  # out of range under every schedule, not only the standard one
        {"ns_steps": 100, "ns_schedule": [(3.0, -4.0, 2.0)]},
        {"normuon_beta2": 1.0},
        {"normuon_eps": 0.0},
    ],
)
def test_gefen_muon_refuses_bad_hyperparameters(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        gefen.GefenMuon([nn.Parameter(torch.zeros(4, 4))], **kwargs)


def test_gefen_muon_fused_option_validation() -> None:
    with pytest.raises(TypeError, match="fused"):
        gefen.GefenMuon([nn.Parameter(torch.zeros(4, 4))], fused="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="float64"):
        gefen.GefenMuon([nn.Parameter(torch.zeros(4, 4, dtype=torch.float64))], fused=True)


def test_gefen_muon_is_built_by_the_shared_initialiser_like_gefen(monkeypatch: pytest.MonkeyPatch) -> None:
    """GefenMuon subclasses Gefen with another signature. Both public constructors only translate their arguments
    and call ``GefenOptimizer._init_optimizer``, so a fresh GefenMuon has every attribute a fresh Gefen has (the
    step machinery it inherits reads them), and no constructor skips its parent's by naming a class."""
    fresh_gefen = gefen.Gefen([nn.Parameter(torch.zeros(4, 4))])
    fresh_muon = gefen.GefenMuon([nn.Parameter(torch.zeros(4, 4))])
    assert sorted(vars(fresh_muon)) == sorted(vars(fresh_gefen))
    calls = []

    def record(self: GefenOptimizer, params: object, defaults: dict, **options: object) -> None:
        calls.append((type(self).__name__, list(defaults), sorted(options["flags"])))  # type: ignore[call-overload]

    monkeypatch.setattr(GefenOptimizer, "_init_optimizer", record)
    for cls in (gefen.Gefen, gefen.GefenMuon):
        assert vars(cls([nn.Parameter(torch.zeros(4, 4))])) == {}  # the constructor itself sets nothing up
    assert calls == [
        ("Gefen", ["lr", "betas", "eps", "weight_decay", "factored_v_2d"], ["factored_v_2d"]),
        (
            "GefenMuon",
            ["lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn"]
            + ["ns_schedule", "normuon", "normuon_beta2", "normuon_eps", "sharded_mode"],
            ["nesterov", "normuon"],
        ),
    ]
    source = Path(gefen.__file__).parent
    explicit = [
        f"{path.relative_to(source)}:{number}: {line.strip()}"
        for path in sorted(source.rglob("*.py"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if re.search(r"\bsuper\(\s*\w|\b\w+\.__init__\(\s*self\b", line)
    ]
    assert explicit == []


@pytest.mark.parametrize("cls", [gefen.Gefen, gefen.GefenMuon])
@pytest.mark.parametrize(
    ("kwargs", "env", "error", "message"),
    [
        ({"bogus": 1}, "1", TypeError, r"^{kind}\.__init__\(\) got an unexpected keyword argument 'bogus'$"),
        ({"maximize": True}, "1", ConfigError, r"^{kind} does not implement torch\.optim\.AdamW's maximize=True;"),
        ({"fused": 1}, "1", TypeError, r"^{kind} fused=1 must be None, True or False\.$"),
        ({"fused": True, "backend": "eager"}, "1", ConfigError, r"^{kind}: fused=True means backend='compiled'"),
        ({}, "maybe", ConfigError, r"^environment variable GEFEN_FUSED='maybe' must be"),
    ],
)
def test_shared_constructor_options_are_refused_by_both_optimizers(
    monkeypatch: pytest.MonkeyPatch, cls: type, kwargs: dict, env: str, error: type, message: str
) -> None:
    """The checks both constructors share run once, in ``GefenOptimizer._init_optimizer``, naming the class."""
    monkeypatch.setenv("GEFEN_FUSED", env)
    with pytest.raises(error, match=message.format(kind=cls.__name__)):
        cls([nn.Parameter(torch.zeros(4, 4))], **kwargs)


def test_gefen_muon_resumes_bit_exactly_and_refused_loads_change_nothing() -> None:
    w0, target = _matrix_problem(3)

    def run(p: nn.Parameter, opt: torch.optim.Optimizer, steps: int) -> None:
        for _ in range(steps):
            loss = (p - target).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

    p = nn.Parameter(w0.clone())
    opt = gefen.GefenMuon([p], lr=0.02, normuon=True)
    run(p, opt, 3)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    q = nn.Parameter(p.detach().clone())
    resumed = gefen.GefenMuon([q], lr=0.02, normuon=True)
    resumed.load_state_dict(saved)
    run(p, opt, 3)
    run(q, resumed, 3)
    assert torch.equal(p, q)
    # refusals: a Gefen checkpoint, a NorMuon-less optimizer, a negative NorMuon counter
    fresh = gefen.GefenMuon([nn.Parameter(w0.clone())], lr=0.02, normuon=True)
    gefen_opt = gefen.Gefen([nn.Parameter(w0.clone())])
    with pytest.raises(CheckpointError, match="GefenMuon"):
        fresh.load_state_dict(gefen_opt.state_dict())
    bad = copy.deepcopy(saved)
    bad["state"][0]["normuon_step"] = torch.tensor(-1)
    with pytest.raises(CheckpointError, match="normuon_step"):
        fresh.load_state_dict(bad)
    assert len(fresh.state) == 0 and fresh.codebook is None


# ---------------------------------------------------------------------------------------------- routing
class _Toy(nn.Module):
    """algorithm.md §8.1's toy: only q_proj.weight belongs to Muon."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(50, 16)
        self.pos_embed = nn.Parameter(torch.zeros(8, 16))
        self.q_proj = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.conv = nn.Conv1d(16, 16, 3, padding=1)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.classifier = nn.Linear(16, 3)
        self.frozen = nn.Linear(16, 16, bias=False)
        self.frozen.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos_embed[: x.shape[1]]
        h = self.norm(self.q_proj(h)) + self.frozen(h)
        h = self.conv(h.transpose(1, 2)).transpose(1, 2)
        return self.head(h).mean() + self.classifier(h).mean()


def test_routing_of_the_toy_model() -> None:
    model = _Toy()
    muon, backup = gefen.split_params_for_muon(model)
    assert [n for n, _ in muon] == ["q_proj.weight", "frozen.weight"]  # frozen ones too: torch.optim holds them
    names = {n for n, _ in backup}
    assert {"tok.weight", "pos_embed", "q_proj.bias", "norm.weight", "conv.weight", "classifier.weight"} <= names
    gefen.validate_split(muon, backup, model)


def test_validate_split_errors() -> None:
    model = _Toy()
    muon, backup = gefen.split_params_for_muon(model)
    with pytest.raises(ValueError, match="listed twice"):
        gefen.validate_split(muon, backup + muon[:1])
    with pytest.raises(ValueError, match="not unique"):
        gefen.validate_split(muon, [("Q_PROJ.WEIGHT", torch.zeros(1))])
    with pytest.raises(ValueError, match="neither half"):
        gefen.validate_split(muon, backup[1:], model)
    with pytest.raises(TypeError):
        gefen.validate_split([torch.zeros(2, 2)], [])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        gefen.split_params_for_muon([torch.zeros(2, 2)])  # type: ignore[list-item]


# ---------------------------------------------------------------------------------------------- the hybrid
@pytest.mark.parametrize("backup", ["gefen", "adamw"])
def test_hybrid_behaves_as_one_optimizer(backup: str) -> None:
    torch.manual_seed(0)
    model = _Toy()
    opt = gefen.GefenMuonHybrid(model, lr=1e-2, backup_optimizer=backup, weight_decay=0.01)
    assert isinstance(opt.muon, gefen.GefenMuon)
    assert isinstance(opt.backup, gefen.Gefen if backup == "gefen" else torch.optim.AdamW)
    assert len(opt.param_groups) == 2 and opt.param_groups[0] is opt.muon.param_groups[0]
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x = torch.randint(0, 50, (4, 8))
    calls = []

    def closure() -> torch.Tensor:
        calls.append(1)
        opt.zero_grad()
        loss = model(x)
        loss.backward()
        return loss

    order = []
    opt.muon.register_step_post_hook(lambda *a: order.append("muon"))
    opt.backup.register_step_post_hook(lambda *a: order.append("backup"))
    for _ in range(3):
        opt.step(closure)
        scheduler.step()
    assert len(calls) == 3 and order == ["muon", "backup"] * 3
    assert opt.muon.param_groups[0]["lr"] == pytest.approx(1e-2 / 8)
    assert opt.backup.param_groups[0]["lr"] == pytest.approx(1e-2 / 8)
    assert opt.state[model.q_proj.weight] is opt.muon.state[model.q_proj.weight]
    groups = list(opt.param_groups)
    opt.param_groups = groups[::-1]  # a plain list, assigned as on a torch optimizer (issue 36)
    assert opt.param_groups[0] is groups[1] and opt.muon.param_groups == [groups[0]]


@pytest.mark.parametrize("backup", ["gefen", "adamw"])
def test_hybrid_add_param_group_routes_by_the_constructor_rule_case_002(backup) -> None:
    """Case 002: add_param_group routes a group to its half (the rule, or an explicit ``hybrid_half``); a group
    the rule would split is refused with the fix; the new groups train and checkpoint in torch's layout."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 16), torch.nn.LayerNorm(16))
    opt = gefen.GefenMuonHybrid(model, lr=1e-3, backup_optimizer=backup)
    extra_matrix = torch.nn.Parameter(torch.randn(16, 16) * 0.1)
    extra_bias = torch.nn.Parameter(torch.zeros(3))
    head = torch.nn.Parameter(torch.randn(16, 16) * 0.1)
    n_muon, n_backup = len(opt.muon.param_groups), len(opt.backup.param_groups)
    with pytest.raises(ConfigError, match=r"cannot route one group to both halves.*hybrid_half"):
        opt.add_param_group({"params": [extra_matrix, extra_bias]})
    with pytest.raises(ConfigError, match="hybrid_half='middle' must be"):
        opt.add_param_group({"params": [extra_bias], "hybrid_half": "middle"})
    with pytest.raises(ConfigError, match="already in this hybrid"):
        opt.add_param_group({"params": [model[1].weight]})
    assert (len(opt.muon.param_groups), len(opt.backup.param_groups)) == (n_muon, n_backup)  # nothing added
    opt.add_param_group({"params": [extra_matrix], "lr": 2e-3})  # 2-D, unnamed: Muon
    opt.add_param_group({"params": [extra_bias]})  # 1-D: backup (case 002's call)
    opt.add_param_group({"params": [("lm_head.weight", head)]})  # backup substring: backup
    assert opt.muon.param_groups[-1]["params"] == [extra_matrix] and opt.muon.param_groups[-1]["lr"] == 2e-3
    assert [g["params"] for g in opt.backup.param_groups[-2:]] == [[extra_bias], [head]]
    x = torch.randint(0, 32, (4, 6))
    before = [p.detach().clone() for p in (extra_matrix, extra_bias, head)]
    (model(x).square().mean() + (model(x) @ extra_matrix @ head).square().mean() + extra_bias.square().sum()).backward()
    extra_bias.grad = torch.ones(3)
    opt.step()
    assert all(not torch.equal(p, q) for p, q in zip((extra_matrix, extra_bias, head), before))
    sd = opt.state_dict()
    halves = ["muon"] * n_muon + ["backup"] * n_backup + ["muon", "backup", "backup"]  # list order (issue 36)
    assert [g["hybrid_half"] for g in sd["param_groups"]] == halves
    assert sorted(sd["state"]) == list(range(sum(len(g["params"]) for g in sd["param_groups"])))


def test_hybrid_with_gefen_backup_holds_about_one_byte_per_param() -> None:
    model = nn.Sequential(nn.Embedding(512, 256), nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
    opt = gefen.GefenMuonHybrid(model, lr=1e-3)
    x = torch.randint(0, 512, (8, 16))
    model(x).square().mean().backward()
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    total = opt.muon.state_bytes() + opt.backup.state_bytes()
    assert total / n < 1.1


def test_hybrid_resumes_bit_exactly_and_refuses_mismatched_checkpoints() -> None:
    torch.manual_seed(1)
    model = _Toy()
    x = torch.randint(0, 50, (4, 8))

    def run(m: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
        for _ in range(steps):
            opt.zero_grad()
            m(x).backward()
            opt.step()

    opt = gefen.GefenMuonHybrid(model, lr=1e-2)
    run(model, opt, 2)
    saved = copy.deepcopy(opt.state_dict())
    twin = copy.deepcopy(model)
    resumed = gefen.GefenMuonHybrid(twin, lr=1e-2)
    resumed.load_state_dict(saved)
    run(model, opt, 2)
    run(twin, resumed, 2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))

    fresh = gefen.GefenMuonHybrid(copy.deepcopy(model), lr=1e-2)
    assert {"state", "param_groups"} <= set(saved)  # torch.optim's layout
    other = copy.deepcopy(saved)
    other["gefen_hybrid"]["backup_optimizer"] = "adamw"  # one object with the group mirrors after a deepcopy
    with pytest.raises(CheckpointError, match="backup optimizer"):
        fresh.load_state_dict(other)
    muon_only = {
        "state": saved["state"],
        "param_groups": [g for g in saved["param_groups"] if g["hybrid_half"] == "muon"],
    }
    with pytest.raises(CheckpointError, match="no param group lists"):
        fresh.load_state_dict(muon_only)
    broken = copy.deepcopy(saved)
    first_backup = next(g for g in broken["param_groups"] if g["hybrid_half"] == "backup")["params"][0]
    entry = broken["state"][first_backup]
    entry["first_moment_scale"] = -entry["first_moment_scale"] - 1
    with pytest.raises(CheckpointError, match="backup half"):
        fresh.load_state_dict(broken)
    assert len(fresh.state) == 0  # neither half was touched (the Muon half was valid)
    assert fresh.muon.codebook is None and fresh.backup.codebook is None


def test_hybrid_refuses_bad_construction() -> None:
    with pytest.raises(ConfigError, match="backup_optimizer"):
        gefen.GefenMuonHybrid(_Toy(), lr=1e-3, backup_optimizer="sgd")
    with pytest.raises(TypeError, match="single Tensor"):
        gefen.GefenMuonHybrid(torch.zeros(2, 2, requires_grad=True), lr=1e-3)
    with pytest.raises(TypeError, match="mix kinds"):
        gefen.GefenMuonHybrid([torch.zeros(2, 2, requires_grad=True), ("b", torch.zeros(2))], lr=1e-3)
    with pytest.warns(UserWarning, match="match_rms_adamw"):
        gefen.GefenMuonHybrid(_Toy(), lr=1e-3, adjust_lr_fn="original")
    with pytest.raises(ConfigError, match="no parameter"):
        gefen.GefenMuonHybrid(nn.ReLU(), lr=1e-3)


def _flattened_model() -> nn.Module:
    flat = nn.Module()  # ../shared/cases/005: a 64x32 weight flattened to 1-D by a sharding wrapper
    flat.w = nn.Parameter(torch.randn(64 * 32))
    flat.b = nn.Parameter(torch.zeros(32))
    return flat


@pytest.mark.parametrize(
    "build,reason",
    [
        (lambda: gefen.GefenMuonHybrid(_flattened_model(), lr=1e-3), "flattened by a wrapper"),
        (lambda: gefen.GefenMuonHybrid(nn.Sequential(nn.Embedding(10, 4)), lr=1e-3), "embeddings or match"),
        (lambda: gefen.GefenMuonHybrid([("w", nn.Parameter(torch.zeros(0, 5)))], lr=1e-3), "no elements"),
        (lambda: gefen.GefenMuonHybrid(_Toy(), lr=1e-3, backup_substrings=("",)), "match backup_substrings"),
        (lambda: gefen.GefenMuonHybrid([("b", nn.Parameter(torch.zeros(3)))], lr=1e-3), "no parameter is a 2-D"),
    ],
)
def test_hybrid_with_nothing_for_muon_says_so_at_construction(build, reason) -> None:
    """Case 005: a hybrid whose Muon half holds no element is a plain backup optimizer; it says so and why."""
    with pytest.warns(UserWarning, match="no parameter qualifies for Muon") as caught:
        opt = build()
    assert any(reason in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert opt.muon is None or all(p.numel() == 0 for g in opt.muon.param_groups for p in g["params"])


def test_hybrid_with_muon_work_does_not_warn() -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gefen.GefenMuonHybrid(_Toy(), lr=1e-3)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"backup_lr": -1.0}, "backup_lr=-1.0"),
        ({"backup_weight_decay": -0.5}, "backup_weight_decay=-0.5"),
        ({"muon_weight_decay": float("nan")}, "muon_weight_decay=nan"),
        ({"weight_decay": -1}, "weight_decay=-1"),
        ({"lr": "fast"}, "lr='fast'"),
        ({"eps": 0.0}, "eps=0.0"),
        ({"betas": (0.9, 1.0)}, "betas[1]=1.0"),
    ],
)
@pytest.mark.parametrize("backup", ["gefen", "adamw"])
def test_hybrid_errors_name_the_argument_passed(kwargs, name, backup) -> None:
    """Messages say ``backup_lr``, not the child's ``backup['lr']``."""
    kwargs = {"lr": 1e-3, **kwargs}
    with pytest.raises(ConfigError) as caught:
        gefen.GefenMuonHybrid(_Toy(), backup_optimizer=backup, **kwargs)
    message = str(caught.value)
    assert message.startswith("GefenMuonHybrid: ") and name in message and "['" not in message, message


# ---------------------------------------------------------------------------------------------- torch.optim contract
def test_gefen_muon_tensor_lr_equals_float_lr_and_lr_zero_freezes() -> None:
    w0, target = _matrix_problem(4)
    results = []
    for lr in (0.05, torch.tensor(0.05), 0.0):
        p = nn.Parameter(w0.clone())
        opt = gefen.GefenMuon([p], lr=lr, weight_decay=0.1)
        for _ in range(2):
            opt.zero_grad()
            (p - target).square().mean().backward()
            opt.step()
        results.append(p.detach().clone())
    assert torch.equal(results[0], results[1])
    assert torch.equal(results[2], w0)  # lr 0: neither the update nor the (lr-scaled) decay moves it


def test_gefen_muon_param_without_grad_is_untouched_and_refused_steps_change_nothing() -> None:
    a, b = nn.Parameter(torch.randn(16, 8)), nn.Parameter(torch.randn(8, 16))
    opt = gefen.GefenMuon([a, b], lr=0.05)
    a.grad = torch.randn(16, 8)
    before_b = b.detach().clone()
    opt.step()
    assert torch.equal(b, before_b) and b not in opt.state
    snapshot = (a.detach().clone(), {k: v.clone() for k, v in opt.state[a].items()})
    a.grad = torch.randn(16, 8)
    b.grad = torch.randn(8, 16).to_sparse()  # a sparse gradient: refused before anything changes
    with pytest.raises(gefen.StepError, match="strided"):
        opt.step()
    assert torch.equal(a, snapshot[0])
    assert all(torch.equal(opt.state[a][k], v) for k, v in snapshot[1].items())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_gefen_muon_writes_each_dtype_in_its_own_dtype(dtype: torch.dtype) -> None:
    p = nn.Parameter(torch.randn(32, 16).to(dtype))
    opt = gefen.GefenMuon([p], lr=0.05)
    p.grad = torch.randn(32, 16).to(dtype)
    before = p.detach().clone()
    opt.step()
    assert p.dtype == dtype and not torch.equal(p, before) and bool(torch.isfinite(p).all())
    assert opt.state[p]["first_moment_codes"].dtype == torch.uint8


def test_gefen_muon_add_param_group_and_normuon_toggle() -> None:
    p, q = nn.Parameter(torch.randn(16, 8)), nn.Parameter(torch.randn(12, 10))  # rows of >= 8: NorMuon applies
    opt = gefen.GefenMuon([p], lr=0.05)
    opt.add_param_group({"params": [q], "normuon": True, "ns_schedule": "tuned4"})
    with pytest.raises(ConfigError, match="2-D"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(5))]})
    p.grad, q.grad = torch.randn(16, 8), torch.randn(12, 10)
    opt.step()
    assert "normuon_v" in opt.state[q] and "normuon_v" not in opt.state[p]
    opt.param_groups[0]["normuon"] = True  # switched on mid-run: its state is created then
    p.grad, q.grad = torch.randn(16, 8), torch.randn(12, 10)
    opt.step()
    assert int(opt.state[p]["normuon_step"]) == 1 and int(opt.state[q]["normuon_step"]) == 2


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_hybrid_deepcopy_and_pickle_give_a_working_optimizer(how: str) -> None:
    import pickle

    torch.manual_seed(2)
    model = _Toy()
    x = torch.randint(0, 50, (4, 8))
    opt = gefen.GefenMuonHybrid(model, lr=1e-2)
    opt.zero_grad()
    model(x).backward()
    opt.step()
    model2, opt2 = copy.deepcopy((model, opt)) if how == "deepcopy" else pickle.loads(pickle.dumps((model, opt)))
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        m(x).backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def test_hybrid_with_adamw_backup_refuses_a_sparse_backup_gradient_before_muon_steps() -> None:
    model = _Toy()
    opt = gefen.GefenMuonHybrid(model, lr=1e-2, backup_optimizer="adamw")
    x = torch.randint(0, 50, (4, 8))
    model(x).backward()
    model.norm.weight.grad = model.norm.weight.grad.to_sparse()
    before = model.q_proj.weight.detach().clone()
    with pytest.raises(gefen.StepError, match="norm.weight"):
        opt.step()
    assert torch.equal(model.q_proj.weight, before) and len(opt.muon.state) == 0


@pytest.mark.parametrize("factored", [False, True])
def test_hybrid_backup_factored_v_2d_option(factored: bool) -> None:
    """``backup_factored_v_2d=True`` gives the Gefen backup's 2-D weights (embedding, head) the factored second
    moment (row and column statistics), the fine-tuning recipe; the default keeps algorithm.md §8.2's block one."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 16), nn.Linear(16, 32))  # backup 2-D: factorable
    named = [
        ("embed.weight", model[0].weight),
        ("hidden.weight", model[1].weight),
        ("classifier.weight", model[2].weight),
    ]
    opt = gefen.GefenMuonHybrid(named, lr=1e-3, backup_factored_v_2d=factored)
    assert opt.backup is not None
    assert [g["factored_v_2d"] for g in opt.backup.param_groups] == [factored] * len(opt.backup.param_groups)
    for _, p in named:
        p.grad = torch.randn_like(p)
    opt.step()
    for weight in (model[0].weight, model[2].weight):
        keys = set(opt.backup.state[weight])
        assert ({"second_moment_row", "second_moment_col"} <= keys) is factored, keys
        assert ("second_moment" in keys) is not factored, keys
    with pytest.raises(TypeError):
        gefen.GefenMuonHybrid(named, lr=1e-3, backup_factored_v_2d=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", ["native", "eager"])
def test_gefen_muon_momenta_in_parts_bound_memory_and_change_nothing(
    monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """The momenta ``m̂`` (fp32 buffers) of consecutive parameters are computed together only up to
    ``MOMENTUM_PART_ELEMENTS``, then orthogonalised and freed: with a budget of one matrix every part holds one
    parameter, and the weights and state are bit-identical to one part for the whole model."""
    import gefen.optim.muon as muon_module

    if backend == "native" and not gefen.kernels.native_status().available:
        pytest.skip("native library not built")
    shapes = [(32, 48), (48, 32), (16, 64), (64, 16)]

    def run(budget: int) -> tuple[list[torch.Tensor], dict, list[list[int]]]:
        monkeypatch.setattr(muon_module, "MOMENTUM_PART_ELEMENTS", budget)
        gen = torch.Generator().manual_seed(3)
        ws = [nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
        opt = gefen.GefenMuon(ws, lr=0.02, weight_decay=0.01, backend=backend)
        seen: list[list[int]] = []
        finish = opt._finish_jobs

        def spy(jobs):  # type: ignore[no-untyped-def]
            seen.append([job.target.numel() for job in jobs])
            assert all(job.out is not None for job in jobs)
            finish(jobs)
            assert all(job.out is None for job in jobs)  # freed once written

        opt._finish_jobs = spy  # type: ignore[method-assign]
        for step in range(3):
            g = torch.Generator().manual_seed(10 + step)
            for w in ws:
                w.grad = torch.randn(w.shape, generator=g)
            opt.step()
        return ws, opt.state_dict(), seen

    whole, whole_state, whole_parts = run(1 << 24)
    split, split_state, split_parts = run(32 * 48)
    assert whole_parts == [[1536, 1536, 1024, 1024]] * 3
    assert split_parts == [[1536], [1536], [1024], [1024]] * 3
    assert all(torch.equal(a, b) for a, b in zip(whole, split))
    for i in whole_state["state"]:
        assert all(torch.equal(whole_state["state"][i][k], split_state["state"][i][k]) for k in whole_state["state"][i])
