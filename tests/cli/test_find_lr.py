"""Tests of the LR range test: ``gefen.lr_finder`` on problems whose answer follows from the math, and the
``gefen find-lr`` command on the tiny demo model.

The reference problem is least squares ``loss(w) = mean((X w - y)^2)`` with ``y = X w*`` (no noise), trained by
plain SGD. Its Hessian is ``H = 2 X^T X / n``; we build ``X`` so that ``H = lam * I`` exactly. One SGD step
multiplies the error ``e = w - w*`` by ``(1 - lr * lam)``, so the loss after updates at ``lr_0 .. lr_{k-1}`` is

    loss_k = loss_0 * prod_{j<k} (1 - lr_j * lam)^2.

Hence: the loss never rises while ``lr * lam < 2`` and rises at every update with ``lr * lam > 2`` (the
stability limit ``2 / lam_max``); the recorded loss is lowest at the first ramp lr above ``2 / lam``; an lr
above ``2 / lam`` can never be a good constant lr.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from gefen.lr_finder import (
    RULE,
    STOP_REASONS,
    LRFinderResult,
    exponential_ramp,
    find_lr,
    plot_lr_curves,
    smooth_losses,
    suggest_lr,
)

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_LAM = 4.0  # the Hessian's (only) eigenvalue: the stability limit of SGD is 2 / _LAM = 0.5
_DIM, _ROWS = 8, 64


def _least_squares(lam: float = _LAM) -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    """A float64 ``nn.Linear(8, 1)`` without bias at w = 0, and ``(X, y)`` with ``2 X^T X / n = lam * I``."""
    generator = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(_ROWS, _DIM, generator=generator, dtype=torch.float64))
    x = q * math.sqrt(_ROWS * lam / 2)  # q^T q = I, so 2 x^T x / n = lam * I
    w_star = torch.randn(_DIM, generator=generator, dtype=torch.float64)
    model = nn.Linear(_DIM, 1, bias=False).double()
    with torch.no_grad():
        model.weight.zero_()
    return model, x, x @ w_star


def _mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.mean((model(x).squeeze(-1) - y) ** 2)


def _sgd(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr)


def _run_least_squares(**kwargs: object) -> LRFinderResult:
    model, x, y = _least_squares()
    steps = int(kwargs.pop("steps", 60))  # type: ignore[call-overload]
    settings = {"lr_min": 1e-4, "lr_max": 10.0, "smoothing": 0.0} | kwargs
    return find_lr(model, _sgd, [(x, y)] * steps, _mse, steps=steps, **settings)  # type: ignore[arg-type]


def test_least_squares_setup_has_the_stated_hessian() -> None:
    _, x, _ = _least_squares()
    hessian = 2 * x.T @ x / _ROWS
    torch.testing.assert_close(hessian, _LAM * torch.eye(_DIM, dtype=torch.float64))


# --- the ramp ---------------------------------------------------------------------------------------------------


def test_ramp_is_exponential_from_lr_min_to_lr_max() -> None:
    lrs = exponential_ramp(1e-4, 1.0, 9)
    assert lrs[0] == 1e-4 and lrs[-1] == 1.0
    expected = [1e-4 * 10 ** (i / 2) for i in range(9)]  # 4 decades over 8 intervals: x sqrt(10) per step
    assert lrs == pytest.approx(expected, rel=1e-12)
    assert all(b / a == pytest.approx(math.sqrt(10), rel=1e-12) for a, b in zip(lrs, lrs[1:]))


class _RecordingSGD(torch.optim.SGD):
    """SGD that records every group's lr at each ``step()`` (what the finder really set)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.seen: list[list[float]] = []

    def step(self, closure: object = None) -> None:  # type: ignore[override]
        self.seen.append([group["lr"] for group in self.param_groups])
        super().step()


def test_ramp_sets_every_groups_lr_keeping_the_factory_ratio() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    built: list[_RecordingSGD] = []

    def factory(trial: nn.Module, lr: float) -> torch.optim.Optimizer:
        groups = [{"params": trial[0].parameters()}, {"params": trial[1].parameters(), "lr": 3 * lr}]
        built.append(_RecordingSGD(groups, lr=lr))
        return built[0]

    x = torch.randn(16, 3)
    batch = (x, x.sum(dim=1))
    result = find_lr(model, factory, [batch] * 12, _mse, lr_min=1e-5, lr_max=1e-3, steps=12, smoothing=0.5)
    assert result.stop_reason == "completed"
    ramp = [1e-5 * 100 ** (i / 11) for i in range(12)]
    assert result.lrs == pytest.approx(ramp, rel=1e-12)
    assert [first for first, _ in built[0].seen] == pytest.approx(ramp, rel=1e-12)
    assert [second for _, second in built[0].seen] == pytest.approx([3 * lr for lr in ramp], rel=1e-12)


def test_recorded_lrs_increase_strictly_and_match_the_documented_formula() -> None:
    result = _run_least_squares(lr_min=1e-3, lr_max=1e-1, steps=30)
    assert result.stop_reason == "completed" and len(result.lrs) == 30
    assert all(b > a for a, b in zip(result.lrs, result.lrs[1:]))
    log_step = math.log(100) / 29
    assert [math.log(b / a) for a, b in zip(result.lrs, result.lrs[1:])] == pytest.approx([log_step] * 29, rel=1e-9)


# --- smoothing ---------------------------------------------------------------------------------------------------


def test_smoothing_is_a_bias_corrected_ema() -> None:
    # By hand, smoothing 0.5: the weights of losses (1, 2, 3) at the last point are (0.25, 0.5, 1) / 1.75.
    assert smooth_losses([1.0, 2.0, 3.0], 0.5) == pytest.approx([1.0, 2.5 / 1.5, 4.25 / 1.75], rel=1e-12)
    assert smooth_losses([5.0, 5.0, 5.0, 5.0], 0.98) == pytest.approx([5.0] * 4, rel=1e-12)  # no bias to zero
    assert smooth_losses([3.0, 1.0], 0.0) == [3.0, 1.0]


def test_result_smoothed_losses_follow_the_raw_losses() -> None:
    result = _run_least_squares(lr_min=1e-3, lr_max=1e-1, steps=20, smoothing=0.7)
    assert result.smoothed_losses == pytest.approx(smooth_losses(result.losses, 0.7), rel=1e-12)


# --- the math of the least-squares problem ------------------------------------------------------------------------


def test_loss_follows_the_sgd_contraction_factor() -> None:
    result = _run_least_squares(steps=40)
    for k in range(1, len(result.losses)):
        factor = (1 - result.lrs[k - 1] * _LAM) ** 2
        assert result.losses[k] == pytest.approx(result.losses[k - 1] * factor, rel=1e-9, abs=1e-300)


def test_minimum_is_at_the_first_lr_past_the_stability_limit() -> None:
    result = _run_least_squares(steps=60)
    first_unstable = min(lr for lr in exponential_ramp(1e-4, 10.0, 60) if lr * _LAM > 2)
    assert result.min_loss_lr == first_unstable


def test_early_stop_when_the_loss_diverges() -> None:
    result = _run_least_squares(steps=60, diverge_factor=4.0)
    assert result.stop_reason == "diverged"
    assert len(result.lrs) < 60 and result.stopped_at_lr == result.lrs[-1]
    assert result.stopped_at_lr > 2 / _LAM  # the loss cannot rise below the stability limit
    assert result.smoothed_losses[-1] > 4.0 * min(result.smoothed_losses)
    assert all(loss <= 4.0 * min(result.smoothed_losses[: i + 1]) for i, loss in enumerate(result.smoothed_losses[:-1]))


def test_a_loss_shifted_below_zero_stops_where_the_positive_one_does() -> None:
    """The divergence test compares the rise above the minimum with ``(factor - 1) * |minimum|``: a loss that
    goes negative must not count as diverged at its first point. MSE - c and MSE share every update (same
    gradients); with factor 4 the shifted ramp stops where the rise above its minimum exceeds 3 |minimum|."""
    model, x, y = _least_squares()
    shift = 100.0
    shifted = find_lr(
        model,
        _sgd,
        [(x, y)] * 60,
        lambda m, b: _mse(m, b) - shift,
        lr_min=1e-4,
        lr_max=10.0,
        steps=60,
        smoothing=0.0,
        diverge_factor=4.0,
    )
    plain = _run_least_squares(steps=60, diverge_factor=1e300)  # same ramp, not stopped before n
    assert shifted.stop_reason == "diverged" and len(shifted.lrs) > 1
    n = len(shifted.lrs)
    assert len(plain.lrs) >= n
    assert shifted.lrs == plain.lrs[:n]
    expected = [loss - shift for loss in plain.losses[:n]]
    assert shifted.losses == pytest.approx(expected, rel=0, abs=1e-9)
    best = [min(expected[: i + 1]) for i in range(n)]
    assert expected[-1] - best[-1] > 3.0 * abs(best[-1])  # the stopping point satisfies the rule...
    assert all(e - b <= 3.0 * abs(b) for e, b in zip(expected[:-1], best[:-1]))  # ...and no earlier one does


def test_no_early_stop_below_the_stability_limit() -> None:
    result = _run_least_squares(lr_min=1e-4, lr_max=1.9 / _LAM, steps=40, diverge_factor=1.01)
    assert result.stop_reason == "completed" and len(result.lrs) == 40


def test_nan_loss_stops_the_ramp_without_raising() -> None:
    model, x, y = _least_squares()
    poisoned = x.clone()
    poisoned[0, 0] = float("nan")
    batches = [(x, y)] * 7 + [(poisoned, y)] + [(x, y)] * 12
    result = find_lr(model, _sgd, batches, _mse, lr_min=1e-4, lr_max=1e-2, steps=20, smoothing=0.0)
    assert result.stop_reason == "nonfinite_loss"
    assert len(result.lrs) == 7 and all(math.isfinite(loss) for loss in result.losses)
    assert result.stopped_at_lr == pytest.approx(exponential_ramp(1e-4, 1e-2, 20)[7], rel=1e-12)
    assert json.loads(result.to_json())["stop_reason"] == "nonfinite_loss"


def test_inf_loss_on_the_first_batch_gives_no_suggestion() -> None:
    model, x, y = _least_squares()
    result = find_lr(model, _sgd, [(x * math.inf, y)] * 10, _mse, lr_min=1e-4, lr_max=1e-2, steps=10)
    assert result.stop_reason == "nonfinite_loss" and result.lrs == [] and result.suggested_lr is None
    assert "no loss was recorded" in result.reason
    assert json.loads(result.to_json())["suggested_lr"] is None


def test_fewer_batches_than_steps_ends_the_ramp() -> None:
    model, x, y = _least_squares()
    result = find_lr(model, _sgd, iter([(x, y)] * 6), _mse, lr_min=1e-4, lr_max=1e-2, steps=10)
    assert result.stop_reason == "batches_exhausted" and len(result.lrs) == 6
    assert set(STOP_REASONS) == {"completed", "diverged", "nonfinite_loss", "batches_exhausted"}


# --- the caller's model is untouched ---------------------------------------------------------------------------------


def test_callers_model_params_grads_buffers_mode_and_rng_are_untouched() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 1))
    model.eval()
    for param in model.parameters():
        param.grad = torch.full_like(param, 0.25)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    grads = [param.grad.clone() for param in model.parameters()]
    x = torch.randn(32, 6)
    batch = (x, x[:, 0])
    rng = torch.get_rng_state()
    result = find_lr(
        model,
        lambda trial, lr: torch.optim.AdamW(trial.parameters(), lr=lr),
        [batch] * 15,
        _mse,
        lr_min=1e-4,
        lr_max=1.0,
        steps=15,
    )
    assert len(result.lrs) >= 5  # it trained (dropout drew random numbers, batch norm updated its stats)
    after = model.state_dict()
    assert after.keys() == before.keys()
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    assert all(torch.equal(param.grad, grad) for param, grad in zip(model.parameters(), grads))
    assert not model.training and not any(module.training for module in model.modules())
    assert torch.equal(torch.get_rng_state(), rng)


def test_factory_over_the_callers_parameters_is_refused_before_any_update() -> None:
    model, x, y = _least_squares()
    before = model.weight.detach().clone()
    with pytest.raises(ValueError, match=r"parameter of the caller's model in param_groups\[0\]"):
        find_lr(model, lambda trial, lr: _sgd(model, lr), [(x, y)] * 10, _mse, lr_min=1e-4, lr_max=1e-2, steps=10)
    assert torch.equal(model.weight, before)


# --- validation --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"lr_min": 1e-2, "lr_max": 1e-3}, ValueError, r"lr_min=0\.01 must be < lr_max=0\.001"),
        ({"lr_min": 1e-3, "lr_max": 1e-3}, ValueError, r"must be < lr_max"),
        ({"lr_min": 0.0}, ValueError, r"lr_min=0\.0 must be a finite number > 0"),
        ({"lr_min": -1e-3}, ValueError, r"lr_min=-0\.001 must be a finite number > 0"),
        ({"lr_max": math.inf}, ValueError, r"lr_max=inf must be a finite number > 0"),
        ({"lr_max": math.nan}, ValueError, r"lr_max=nan must be a finite number > 0"),
        ({"lr_min": "1e-3"}, ValueError, r"lr_min='1e-3' must be a finite number"),
        ({"steps": 4}, ValueError, r"steps=4 must be an int >= 5"),
        ({"steps": 10.0}, ValueError, r"steps=10\.0 must be an int >= 5"),
        ({"steps": True}, ValueError, r"steps=True must be an int >= 5"),
        ({"smoothing": 1.0}, ValueError, r"smoothing=1\.0 must be in \[0, 1\)"),
        ({"smoothing": -0.1}, ValueError, r"smoothing=-0\.1 must be in \[0, 1\)"),
        ({"diverge_factor": 1.0}, ValueError, r"diverge_factor=1\.0 must be a finite number > 1"),
        ({"diverge_factor": math.inf}, ValueError, r"diverge_factor=inf must be a finite number > 1"),
        ({"max_grad_norm": 0.0}, ValueError, r"max_grad_norm=0\.0 must be None or a finite number > 0"),
        ({"model": torch.zeros(3)}, TypeError, r"model must be a torch\.nn\.Module, got Tensor"),
        ({"optimizer_factory": "sgd"}, TypeError, r"optimizer_factory must be callable, got str"),
        ({"loss_fn": None}, TypeError, r"loss_fn must be callable, got NoneType"),
        ({"optimizer_factory": lambda m, lr: None}, TypeError, r"returned NoneType; it must return a torch\.optim"),
        (
            {"optimizer_factory": lambda m, lr: torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=lr)},
            ValueError,
            r"not a parameter of the given model",
        ),
        (
            {"optimizer_factory": lambda m, lr: torch.optim.SGD(m.parameters(), lr=0.0)},
            ValueError,
            r"param_groups\[0\] lr=0\.0; every group needs a finite lr > 0",
        ),
        ({"loss_fn": lambda m, b: m(b[0])}, ValueError, r"tensor of shape \(64, 1\) at step 0"),
        ({"loss_fn": lambda m, b: 1.0}, ValueError, r"returned float at step 0"),
        ({"loss_fn": lambda m, b: _mse(m, b).detach()}, ValueError, r"requires grad"),
    ],
)
def test_invalid_arguments_are_refused_with_a_clear_error(
    kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    model, x, y = _least_squares()
    before = model.weight.detach().clone()
    arguments = {"model": model, "optimizer_factory": _sgd, "batches": [(x, y)] * 10, "loss_fn": _mse} | {
        "lr_min": 1e-4,
        "lr_max": 1e-2,
        "steps": 10,
    }
    with pytest.raises(error, match=message):
        find_lr(**(arguments | kwargs))  # type: ignore[arg-type]
    assert torch.equal(model.weight, before)


def test_suggest_lr_needs_points_before_the_minimum() -> None:
    assert suggest_lr([1e-3, 1e-2, 1e-1], [1.0, 2.0, 3.0])[0] is None  # minimum at the first point
    assert suggest_lr([1e-3, 1e-2, 1e-1, 1.0], [3.0, 3.0, 3.0, 3.0])[0] is None  # flat: never decreased
    with pytest.raises(ValueError, match=r"got 2 lrs and 1 losses"):
        suggest_lr([1e-3, 1e-2], [1.0])


# --- JSON and plot -------------------------------------------------------------------------------------------------


def test_to_json_round_trips_every_field(tmp_path: Path) -> None:
    result = _run_least_squares(steps=60, smoothing=0.3, label="sgd")
    report = json.loads(result.to_json())
    assert set(report) == {
        "label",
        "rule",
        "suggested_lr",
        "reason",
        "min_loss_lr",
        "steepest_lr",
        "stop_reason",
        "stopped_at_lr",
        "settings",
        "elapsed_s",
        "lrs",
        "losses",
        "smoothed_losses",
    }
    assert report["label"] == "sgd" and report["rule"] == RULE
    assert report["settings"] == {
        "lr_min": 1e-4,
        "lr_max": 10.0,
        "steps": 60,
        "smoothing": 0.3,
        "diverge_factor": 4.0,
        "max_grad_norm": None,
    }
    assert report["lrs"] == result.lrs and report["losses"] == result.losses
    assert report["smoothed_losses"] == result.smoothed_losses
    assert report["suggested_lr"] == result.suggested_lr in result.lrs
    assert report["stopped_at_lr"] == result.stopped_at_lr and report["elapsed_s"] > 0


def test_plot_writes_a_png(tmp_path: Path) -> None:
    result = _run_least_squares(steps=60, smoothing=0.3, label="sgd")
    path = tmp_path / "lr.png"
    result.plot(str(path))
    blob = path.read_bytes()
    assert blob.startswith(_PNG_SIGNATURE) and len(blob) > 10_000
    with pytest.raises(ValueError, match=r"at least one result"):
        plot_lr_curves({}, str(tmp_path / "empty.png"))


# --- the recommendation rule ----------------------------------------------------------------------------------------


def test_suggest_lr_picks_the_steepest_central_difference_before_the_minimum() -> None:
    # ln(lr) = 0 .. 7, unit spacing. Central differences by hand: index 1: (4.9 - 5) / 2 = -0.05, 2: -0.5,
    # 3: (3 - 4.9) / 2 = -0.95, 4: -0.55, 5: -0.1; the minimum 2.8 is at index 6 (index 7 lies past it).
    lrs = [math.exp(i) for i in range(8)]
    suggested, min_loss_lr, reason = suggest_lr(lrs, [5.0, 5.0, 4.9, 4.0, 3.0, 2.9, 2.8, 9.0])
    assert suggested == lrs[3] and min_loss_lr == lrs[6]
    assert "steepest descent" in reason and "-0.95" in reason


def test_suggestion_on_least_squares_lies_in_the_range_the_math_allows() -> None:
    """The bounds, for x_k = lr_k * lam, r = the ramp's per-step ratio, D_k = loss_k * x_k (2 - x_k) (the drop
    made by update k), and the rule's slope at k proportional to -(D_{k-1} + D_k) (central difference):

    * upper: let m be the last update with x_m <= 1 (so x_m > 1/r). For k >= m + 2 both drops are at most
      loss_{m+1} = loss_m (1 - x_m)^2 <= loss_m (1 - 1/r)^2, while D_m >= loss_m g(1/r). Since
      2 (1 - 1/r)^2 < g(1/r) for our r, the steepest k is at most m + 1: x_k <= r, i.e. lr <= r / lam, one ramp
      step past the optimal constant lr 1/lam and well inside the stability limit 2/lam.
    * lower: updates with x <= t remove at most sum 2 x loss_0 <= 2 t loss_0 r / (r - 1) in all; the rest of the
      drop (the loss ends near 0) is spread over at most M = ln(r / t) / ln r + 1 updates with x in (t, r], so
      some D_k >= loss_0 (1 - 2 t r / (r - 1) - tiny) / M. A point with x_k <= s has slope sum at most
      2 s (1 + 1/r) loss_0, so the steepest point has x > s whenever that is smaller.
    """
    result = _run_least_squares(steps=60, smoothing=0.0)
    r = (10.0 / 1e-4) ** (1 / 59)
    g = (1 / r) * (2 - 1 / r)
    assert 2 * (1 - 1 / r) ** 2 < g  # the premise of the upper bound holds for this ramp
    t = 0.02
    m_steps = math.log(r / t) / math.log(r) + 1
    final_fraction = min(result.losses) / result.losses[0]
    s = (1 - 2 * t * r / (r - 1) - final_fraction) / m_steps / (2 * (1 + 1 / r))
    assert 0.005 < s  # the lower bound is not vacuous
    assert result.suggested_lr is not None
    assert s / _LAM < result.suggested_lr <= r / _LAM * (1 + 1e-12) < 2 / _LAM
    assert result.steepest_lr == result.suggested_lr


# --- the command line ---------------------------------------------------------------------------------------------

_FAST = ["--model-size", "tiny", "--steps", "10", "--batch-size", "4", "--seq-len", "32", "--threads", "1"]


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """12 deterministic Python-looking files (~1.5 KB each): file 9 is held out, the rest is the train split."""
    root = tmp_path_factory.mktemp("corpus")
    words = ("def", "return", "self", "value", "if", "else", "for", "in", "range", "(", ")", ":", "=", "+", "x")
    for i in range(12):
        lines = [" ".join(words[(i + 3 * j + k * k) % len(words)] for k in range(6)) for j in range(60)]
        (root / f"module_{i:02d}.py").write_text("\n".join(lines) + "\n")
    return root


@pytest.mark.slow
def test_cli_compare_adamw_writes_sane_json_and_plot(
    text_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gefen.cli._model import build_model
    from gefen.cli.main import main

    json_path, plot_path = tmp_path / "find_lr.json", tmp_path / "find_lr.png"
    threads = torch.get_num_threads()
    argv = ["find-lr", "--optimizer", "gefen-eager", "--compare-adamw", "--data", str(text_dir), *_FAST]
    argv += ["--lr-min", "1e-4", "--lr-max", "1", "--json", str(json_path), "--plot", str(plot_path)]
    assert main(argv) == 0
    assert torch.get_num_threads() == threads  # --threads is restored after an in-process run
    report = json.loads(json_path.read_text())
    assert set(report) == {
        "model_size",
        "model_params",
        "data",
        "settings",
        "results",
        "ratio_to_adamw",
        "total_time_s",
    }
    assert report["model_size"] == "tiny"
    assert report["model_params"] == sum(p.numel() for p in build_model("tiny", 32, 0).parameters())
    assert report["data"]["n_files"] == 12 and report["settings"]["steps"] == 10
    assert report["settings"]["max_grad_norm"] == 1.0 and report["settings"]["compare_adamw"] is True
    assert list(report["results"]) == ["gefen-eager", "adamw"]
    for name, result in report["results"].items():
        assert result["label"] == name and result["demo_lr"] == 1e-3
        assert result["stop_reason"] in STOP_REASONS and 5 <= len(result["lrs"]) <= 10
        assert result["lrs"] == pytest.approx(exponential_ramp(1e-4, 1.0, 10)[: len(result["lrs"])], rel=1e-12)
        assert abs(result["losses"][0] - math.log(256)) < 0.3  # an untrained byte model predicts ~uniformly
        assert all(math.isfinite(loss) and 0 < loss < 50 for loss in result["losses"])
        assert result["suggested_lr"] in result["lrs"]
    # Same initial weights, same first batch: the first loss does not depend on the optimizer.
    assert report["results"]["gefen-eager"]["losses"][0] == report["results"]["adamw"]["losses"][0]
    ratio = report["results"]["gefen-eager"]["suggested_lr"] / report["results"]["adamw"]["suggested_lr"]
    assert report["ratio_to_adamw"] == pytest.approx(ratio, rel=1e-12)
    out = capsys.readouterr().out
    assert "<- suggested" in out and re.search(r"ratio gefen-eager / adamw: [0-9.e+-]+", out)
    assert plot_path.read_bytes().startswith(_PNG_SIGNATURE)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--lr-min", "1e-2", "--lr-max", "1e-3"], r"--lr-min=0\.01 must be < --lr-max=0\.001"),
        (["--lr-min", "0"], r"--lr-min=0 must be a finite number > 0"),
        (["--steps", "4"], r"--steps=4 must be >= 5"),
        (["--smoothing", "1"], r"--smoothing=1 must be in \[0, 1\)"),
        (["--diverge-factor", "0.5"], r"--diverge-factor=0\.5 must be a finite number > 1"),
        (["--optimizer", "adamw", "--compare-adamw"], r"compares AdamW with itself"),
        (["--json", "/nonexistent-folder/x.json"], r"folder '/nonexistent-folder' does not exist"),
    ],
)
def test_cli_usage_errors_exit_2(extra: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from gefen.cli.main import main

    assert main(["find-lr", *extra]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_cli_refuses_adafactor() -> None:
    from gefen.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["find-lr", "--optimizer", "adafactor"])
    assert exit_info.value.code == 2
