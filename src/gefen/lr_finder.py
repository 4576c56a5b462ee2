"""LR range test: train a copy of a model while the lr grows exponentially, and recommend an lr from the loss.

This module owns the ramp (:func:`exponential_ramp`), the run (:func:`find_lr`), the smoothing, the early stop,
the recommendation rule (:func:`suggest_lr`) and the report (:class:`LRFinderResult`: JSON and plot). It knows
nothing about the demo model or data (``gefen.cli.find_lr`` wires those in) and nothing about any particular
optimizer: ``optimizer_factory(model, lr)`` builds whatever the caller wants to test.

The test (L. N. Smith, "Cyclical Learning Rates for Training Neural Networks", 2017, §3.3) in four lines:

* step ``i`` (0-based) of ``steps`` uses ``lr_i = lr_min · (lr_max / lr_min) ** (i / (steps - 1))``, so the
  first update runs at ``lr_min`` and the last at ``lr_max``; every param group keeps its ratio to the lr the
  factory gave it (a hybrid's ``backup_lr`` stays proportional);
* ``losses[i]`` is the training loss of batch ``i``, computed before update ``i``; it reflects updates
  ``0 .. i-1``;
* the smoothed loss is the bias-corrected exponential moving average
  ``avg_i = smoothing · avg_{i-1} + (1 - smoothing) · loss_i`` (``avg_{-1} = 0``),
  ``smoothed_i = avg_i / (1 - smoothing ** (i + 1))`` (so ``smoothed_0 = loss_0``);
* the ramp stops early when, with ``best_i = min(smoothed_0 .. smoothed_i)``,
  ``smoothed_i - best_i > (diverge_factor - 1) · |best_i|`` (for positive losses: ``smoothed_i > diverge_factor ·
  best_i``; the absolute value keeps the test meaningful for losses that go negative) (that point is kept), or
  when ``loss_i`` is NaN or infinite (that point is dropped and no update is made).

Recommendation (:data:`RULE`): the lr at the steepest descent of the smoothed loss against ``log(lr)``,
searched from the start of the ramp up to the lr of the smoothed loss's minimum. The evidence for this rule
over ``(min-loss lr) / 10`` on the demo model is in ``docs/find_lr.md``.

The run never touches the caller's model, its parameters, gradients or buffers: it trains a
``copy.deepcopy`` (so it needs memory for a second model and its optimizer state), and it restores the
global CPU (and the model's CUDA devices') random number generator state afterwards.
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

__all__ = [
    "RULE",
    "STOP_REASONS",
    "LRFinderResult",
    "exponential_ramp",
    "find_lr",
    "plot_lr_curves",
    "smooth_losses",
    "suggest_lr",
]

#: The recommendation rule, in words (also in every result's ``reason``).
RULE = "steepest descent of the smoothed loss against log(lr), before the smoothed loss's minimum"

#: Why a ramp ended: every step ran, the smoothed loss diverged, a loss was NaN/Inf, or ``batches`` ran out.
STOP_REASONS = ("completed", "diverged", "nonfinite_loss", "batches_exhausted")

#: Fewest recorded points before the minimum that the rule needs to take a slope.
_MIN_POINTS = 3
_PIP_HINT = "pip install 'gefen[demo]'"


@dataclass(frozen=True)
class LRFinderResult:
    """Outcome of one LR range test.

    Attributes:
        lrs: lr of each recorded update, increasing, ``len(lrs) <= steps``.
        losses: training loss of each recorded batch (before its update), finite, same length as ``lrs``;
            in the unit of ``loss_fn`` (nats per byte for the demo model).
        smoothed_losses: bias-corrected exponential moving average of ``losses``, same length.
        suggested_lr: the recommendation by :data:`RULE`, or ``None`` when the curve does not allow one
            (``reason`` says why).
        reason: one sentence: how ``suggested_lr`` was chosen, or why there is none.
        min_loss_lr: lr at the minimum of the smoothed loss (``None`` when nothing was recorded).
        steepest_lr: lr at the steepest descent (the same value as ``suggested_lr``; kept under its own name so
            the JSON stays explicit about which rule produced the recommendation).
        stop_reason: one of :data:`STOP_REASONS`.
        stopped_at_lr: lr of the update at which the ramp stopped early (the diverged point, or the lr whose
            batch gave a NaN/Inf loss), ``None`` when it completed.
        settings: ``lr_min``, ``lr_max``, ``steps``, ``smoothing``, ``diverge_factor``, ``max_grad_norm``.
        elapsed_s: wall time of the ramp in seconds (``time.perf_counter``), copying the model included.
        label: free text naming the run (the optimizer's name in the CLI), used in plots.
    """

    lrs: list[float]
    losses: list[float]
    smoothed_losses: list[float]
    suggested_lr: float | None
    reason: str
    min_loss_lr: float | None
    steepest_lr: float | None
    stop_reason: str
    stopped_at_lr: float | None
    settings: dict[str, Any]
    elapsed_s: float
    label: str = ""
    rule: str = field(default=RULE)

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict of every attribute (plain floats, lists and strings; ``None`` for none)."""
        return {
            "label": self.label,
            "rule": self.rule,
            "suggested_lr": self.suggested_lr,
            "reason": self.reason,
            "min_loss_lr": self.min_loss_lr,
            "steepest_lr": self.steepest_lr,
            "stop_reason": self.stop_reason,
            "stopped_at_lr": self.stopped_at_lr,
            "settings": dict(self.settings),
            "elapsed_s": self.elapsed_s,
            "lrs": list(self.lrs),
            "losses": list(self.losses),
            "smoothed_losses": list(self.smoothed_losses),
        }

    def to_json(self, indent: int | None = 1) -> str:
        """Return :meth:`to_dict` as a JSON string (strict JSON: no NaN or Infinity; recorded losses are finite)."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def plot(self, path: str, title: str | None = None) -> None:
        """Write a PNG of loss against lr (log x axis) with a marker at the suggestion; see :func:`plot_lr_curves`.

        Raises:
            ImportError: matplotlib is not installed (the message names the pip extra).
        """
        plot_lr_curves({self.label or "loss": self}, path, title=title)


def exponential_ramp(lr_min: float, lr_max: float, steps: int) -> list[float]:
    """Return the ``steps`` lrs of the ramp: ``lr_min · (lr_max / lr_min) ** (i / (steps - 1))``, i = 0 .. steps-1.

    Consecutive lrs have the constant ratio ``(lr_max / lr_min) ** (1 / (steps - 1))``; the first is ``lr_min``
    and the last is ``lr_max`` (both exactly).

    Raises:
        ValueError: see :func:`find_lr` for the constraints on ``lr_min``, ``lr_max`` and ``steps``.
    """
    _check_ramp(lr_min, lr_max, steps)
    log_min, log_max = math.log(lr_min), math.log(lr_max)
    lrs = [math.exp(log_min + (log_max - log_min) * i / (steps - 1)) for i in range(steps)]
    lrs[0], lrs[-1] = float(lr_min), float(lr_max)
    return lrs


def smooth_losses(losses: Sequence[float], smoothing: float) -> list[float]:
    """Bias-corrected exponential moving average (Adam's correction applied to a loss curve).

    Args:
        losses: raw losses, finite.
        smoothing: EMA coefficient in ``[0, 1)``; 0 returns ``losses`` unchanged; its lag is about
            ``smoothing / (1 - smoothing)`` points.

    Returns:
        ``smoothed_i = avg_i / (1 - smoothing ** (i + 1))`` with ``avg_i = smoothing · avg_{i-1} +
        (1 - smoothing) · losses_i`` and ``avg_{-1} = 0``; same length as ``losses``.

    Raises:
        ValueError: ``smoothing`` is outside ``[0, 1)``.
    """
    _check_smoothing(smoothing)
    out, average = [], 0.0
    for i, loss in enumerate(losses):
        average = smoothing * average + (1.0 - smoothing) * float(loss)
        out.append(average / (1.0 - smoothing ** (i + 1)))
    return out


def suggest_lr(lrs: Sequence[float], smoothed_losses: Sequence[float]) -> tuple[float | None, float | None, str]:
    """Apply :data:`RULE` to a recorded curve.

    The slope is ``numpy.gradient(smoothed, log(lrs))`` (central differences, one-sided at the ends) over the
    points up to and including the smoothed minimum; the suggestion is the lr of its most negative value.

    Args:
        lrs: increasing lrs, one per recorded point.
        smoothed_losses: smoothed losses, same length.

    Returns:
        ``(suggested_lr, min_loss_lr, reason)``; ``suggested_lr`` is ``None`` when fewer than 3 points lie at
        or before the minimum, or when the smoothed loss never decreases there (``reason`` says which).

    Raises:
        ValueError: the two sequences differ in length.
    """
    if len(lrs) != len(smoothed_losses):
        raise ValueError(f"suggest_lr got {len(lrs)} lrs and {len(smoothed_losses)} losses; pass one loss per lr.")
    if not lrs:
        return None, None, "no loss was recorded (the first batch's loss was NaN/Inf or there was no batch)"
    smoothed = np.asarray(smoothed_losses, dtype=np.float64)
    best = int(np.argmin(smoothed))
    min_loss_lr = float(lrs[best])
    if best + 1 < _MIN_POINTS:
        return (
            None,
            min_loss_lr,
            f"the smoothed loss was lowest at point {best} (lr {min_loss_lr:.3g}); the rule needs at least "
            f"{_MIN_POINTS} points up to the minimum: lower lr_min or raise steps",
        )
    head = smoothed[: best + 1]
    slope = np.gradient(head, np.log(np.asarray(lrs[: best + 1], dtype=np.float64)))
    steepest = int(np.argmin(slope))
    if slope[steepest] >= 0:
        return None, min_loss_lr, "the smoothed loss never decreased before its minimum; lower lr_min"
    lr = float(lrs[steepest])
    reason = (
        f"steepest descent of the smoothed loss ({slope[steepest]:.3g} per unit of ln(lr)) at lr {lr:.3g}, "
        f"before its minimum {head[-1]:.4g} at lr {min_loss_lr:.3g}"
    )
    return lr, min_loss_lr, reason


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_ramp(lr_min: float, lr_max: float, steps: int) -> None:
    for name, value in (("lr_min", lr_min), ("lr_max", lr_max)):
        if not _is_real(value) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"find_lr {name}={value!r} must be a finite number > 0; pass e.g. {name}=1e-6.")
    if not lr_min < lr_max:
        raise ValueError(
            f"find_lr lr_min={lr_min!r} must be < lr_max={lr_max!r}; the ramp grows from lr_min to lr_max."
        )
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 5:
        raise ValueError(f"find_lr steps={steps!r} must be an int >= 5; pass e.g. steps=100.")


def _check_smoothing(smoothing: float) -> None:
    if not _is_real(smoothing) or not 0.0 <= smoothing < 1.0:
        raise ValueError(f"find_lr smoothing={smoothing!r} must be in [0, 1); pass e.g. smoothing=0.9.")


def _check_arguments(
    model: object,
    optimizer_factory: object,
    loss_fn: object,
    diverge_factor: float,
    max_grad_norm: float | None,
) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"find_lr model must be a torch.nn.Module, got {type(model).__name__}.")
    for name, value in (("optimizer_factory", optimizer_factory), ("loss_fn", loss_fn)):
        if not callable(value):
            raise TypeError(f"find_lr {name} must be callable, got {type(value).__name__}.")
    if not _is_real(diverge_factor) or not math.isfinite(diverge_factor) or diverge_factor <= 1.0:
        raise ValueError(
            f"find_lr diverge_factor={diverge_factor!r} must be a finite number > 1; pass e.g. diverge_factor=4."
        )
    if max_grad_norm is not None and (
        not _is_real(max_grad_norm) or not math.isfinite(max_grad_norm) or max_grad_norm <= 0
    ):
        raise ValueError(f"find_lr max_grad_norm={max_grad_norm!r} must be None or a finite number > 0.")


def _group_lr(group: Mapping[str, Any]) -> float:
    lr = group["lr"]
    return float(lr.item()) if isinstance(lr, Tensor) else float(lr)


def _set_lr(optimizer: torch.optim.Optimizer, lr: float, ratios: Sequence[float]) -> None:
    for group, ratio in zip(optimizer.param_groups, ratios):
        if isinstance(group["lr"], Tensor):
            group["lr"].fill_(lr * ratio)  # a capturable optimizer's tensor lr is changed in place
        else:
            group["lr"] = lr * ratio


def _build_optimizer(
    optimizer_factory: Callable[[nn.Module, float], torch.optim.Optimizer],
    trial: nn.Module,
    model: nn.Module,
    lr_min: float,
) -> tuple[torch.optim.Optimizer, list[float]]:
    optimizer = optimizer_factory(trial, lr_min)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"find_lr optimizer_factory(model, lr) returned {type(optimizer).__name__}; it must return a "
            f"torch.optim.Optimizer."
        )
    originals = {id(p) for p in model.parameters()}
    trial_params = {id(p) for p in trial.parameters()}
    for index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            if id(param) in originals:
                raise ValueError(
                    f"find_lr optimizer_factory put a parameter of the caller's model in param_groups[{index}]; "
                    f"build the optimizer over the model it is given (its first argument), which is a copy."
                )
            if id(param) not in trial_params:
                raise ValueError(
                    f"find_lr optimizer_factory put a tensor that is not a parameter of the given model in "
                    f"param_groups[{index}]; build the optimizer over the model it is given."
                )
    ratios = []
    for index, group in enumerate(optimizer.param_groups):
        lr = _group_lr(group)
        if not math.isfinite(lr) or lr <= 0:
            raise ValueError(
                f"find_lr optimizer_factory(model, lr={lr_min:g}) gave param_groups[{index}] lr={lr!r}; every "
                f"group needs a finite lr > 0 proportional to the lr it is given."
            )
        ratios.append(lr / lr_min)
    return optimizer, ratios


def _scalar_loss(loss: object, step: int) -> Tensor:
    if not isinstance(loss, Tensor) or loss.numel() != 1 or not loss.requires_grad:
        described = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else type(loss).__name__
        raise ValueError(
            f"find_lr loss_fn(model, batch) returned {described} at step {step}; it must return a one-element "
            f"tensor that requires grad (e.g. torch.nn.functional.cross_entropy(model(x), y))."
        )
    return loss.reshape(())


def _cuda_devices(model: nn.Module) -> list[int]:
    return sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})


def find_lr(
    model: nn.Module,
    optimizer_factory: Callable[[nn.Module, float], torch.optim.Optimizer],
    batches: Iterable[Any],
    loss_fn: Callable[[nn.Module, Any], Tensor],
    *,
    lr_min: float = 1e-6,
    lr_max: float = 1.0,
    steps: int = 100,
    smoothing: float = 0.9,
    diverge_factor: float = 4.0,
    max_grad_norm: float | None = None,
    progress: Callable[[int, float, float], None] | None = None,
    label: str = "",
) -> LRFinderResult:
    """Run an LR range test on a copy of ``model`` and recommend an lr (see the module docstring).

    Example:
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> x = torch.randn(64, 4)
        >>> y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0])
        >>> model = nn.Linear(4, 1, bias=False)
        >>> result = find_lr(
        ...     model,
        ...     lambda m, lr: torch.optim.SGD(m.parameters(), lr=lr),
        ...     [(x, y)] * 40,
        ...     lambda m, batch: torch.nn.functional.mse_loss(m(batch[0]).squeeze(-1), batch[1]),
        ...     lr_min=1e-4, lr_max=10.0, steps=40, smoothing=0.0,
        ... )
        >>> result.stop_reason, 1e-3 < result.suggested_lr < 1.0
        ('diverged', True)

    Args:
        model: the model to test; it is deep-copied and the copy is trained in training mode. The original
            (parameters, gradients, buffers, mode) is left exactly as it was.
        optimizer_factory: ``optimizer_factory(copy, lr)`` returns a fresh optimizer over ``copy``'s
            parameters whose groups' lrs are ``lr`` (or proportional to it: the ratios are kept on the ramp).
        batches: yields at least ``steps`` batches (any objects ``loss_fn`` accepts); fewer ends the ramp with
            ``stop_reason="batches_exhausted"``.
        loss_fn: ``loss_fn(copy, batch)`` returns the 0-dim (or one-element) training loss tensor.
        lr_min: first lr of the ramp, finite, > 0.
        lr_max: last lr of the ramp, finite, > ``lr_min``.
        steps: updates in the ramp (one batch each), an int >= 5.
        smoothing: EMA coefficient of the smoothed loss, in ``[0, 1)`` (0: no smoothing). Its lag is about
            ``smoothing / (1 - smoothing)`` steps, so keep it well below ``steps``.
        diverge_factor: stop once the smoothed loss rises above its minimum so far by more than
            ``(diverge_factor - 1) · |minimum|`` (this multiple of the minimum for positive losses); finite, > 1.
        max_grad_norm: clip the global gradient L2 norm to this before every update
            (``torch.nn.utils.clip_grad_norm_``); ``None`` for no clipping.
        progress: called after each recorded step as ``progress(step, lr, loss)`` (e.g. to advance a bar).
        label: free text stored in the result (used as the plot's legend).

    Returns:
        the :class:`LRFinderResult`.

    Raises:
        ValueError: an argument breaks the constraints above; ``optimizer_factory`` used the caller's
            parameters (or tensors foreign to the copy) or gave a group a non-positive lr; ``loss_fn`` returned
            something other than a one-element tensor that requires grad. Raised before the first update, or at
            the step where ``loss_fn`` misbehaved (the caller's model is untouched either way).
        TypeError: ``model`` is not an ``nn.Module``, a factory or ``loss_fn`` is not callable, or the factory
            did not return a ``torch.optim.Optimizer``.
        Exception: anything ``loss_fn``, the forward/backward pass or the optimizer raises is propagated.
    """
    _check_ramp(lr_min, lr_max, steps)
    _check_smoothing(smoothing)
    _check_arguments(model, optimizer_factory, loss_fn, diverge_factor, max_grad_norm)
    start = time.perf_counter()
    ramp = exponential_ramp(lr_min, lr_max, steps)
    settings = {
        "lr_min": float(lr_min),
        "lr_max": float(lr_max),
        "steps": steps,
        "smoothing": float(smoothing),
        "diverge_factor": float(diverge_factor),
        "max_grad_norm": None if max_grad_norm is None else float(max_grad_norm),
    }
    with torch.random.fork_rng(devices=_cuda_devices(model)):
        trial = copy.deepcopy(model)
        trial.train()
        trial.zero_grad(set_to_none=True)
        optimizer, ratios = _build_optimizer(optimizer_factory, trial, model, lr_min)
        params = [p for p in trial.parameters() if p.requires_grad]
        lrs: list[float] = []
        losses: list[float] = []
        smoothed: list[float] = []
        average, best = 0.0, math.inf
        stop_reason, stopped_at_lr = "batches_exhausted", None
        iterator = iter(batches)
        for step, lr in enumerate(ramp):
            try:
                batch = next(iterator)
            except StopIteration:
                break
            _set_lr(optimizer, lr, ratios)
            loss = _scalar_loss(loss_fn(trial, batch), step)
            value = float(loss.detach())
            if not math.isfinite(value):
                stop_reason, stopped_at_lr = "nonfinite_loss", lr
                break
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            optimizer.step()
            average = smoothing * average + (1.0 - smoothing) * value
            current = average / (1.0 - smoothing ** (step + 1))
            best = min(best, current)
            lrs.append(lr)
            losses.append(value)
            smoothed.append(current)
            if progress is not None:
                progress(step, lr, value)
            if current - best > (diverge_factor - 1.0) * abs(best):
                stop_reason, stopped_at_lr = "diverged", lr
                break
        else:
            stop_reason = "completed"
        del optimizer, trial
    suggested, min_loss_lr, reason = suggest_lr(lrs, smoothed)
    return LRFinderResult(
        lrs=lrs,
        losses=losses,
        smoothed_losses=smoothed,
        suggested_lr=suggested,
        reason=reason,
        min_loss_lr=min_loss_lr,
        steepest_lr=suggested,
        stop_reason=stop_reason,
        stopped_at_lr=stopped_at_lr,
        settings=settings,
        elapsed_s=time.perf_counter() - start,
        label=label,
    )


def plot_lr_curves(results: Mapping[str, LRFinderResult], path: str, title: str | None = None) -> None:
    """Write one PNG with every result's raw (faint) and smoothed loss against lr, and its suggestion marked.

    The x axis is logarithmic. The y range spans the lowest raw loss to the highest smoothed loss of each
    curve's first tenth (plus a margin), so a diverging tail goes off the top instead of flattening the rest.

    Args:
        results: legend label -> result; at least one.
        path: output file; the format follows the extension (``.png``), written at 120 dpi.
        title: figure title; ``None`` for a default naming the rule.

    Raises:
        ImportError: matplotlib is not installed (the message names the pip extra).
        ValueError: ``results`` is empty.
    """
    if not results:
        raise ValueError("plot_lr_curves needs at least one result.")
    try:
        import matplotlib
    except ImportError:
        raise ImportError(f"plotting an LR range test needs matplotlib; run: {_PIP_HINT}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4.8), constrained_layout=True)
    visible: list[float] = []
    for index, (name, result) in enumerate(results.items()):
        color = f"C{index}"
        if not result.lrs:
            continue
        axes.plot(result.lrs, result.losses, color=color, alpha=0.25, linewidth=0.8)
        label = name if result.suggested_lr is None else f"{name}: suggested lr {result.suggested_lr:.3g}"
        axes.plot(result.lrs, result.smoothed_losses, color=color, label=label)
        if result.suggested_lr is not None:
            at = result.lrs.index(result.suggested_lr)
            axes.plot([result.suggested_lr], [result.smoothed_losses[at]], "o", color=color, markersize=8)
            axes.axvline(result.suggested_lr, color=color, linestyle=":", linewidth=1)
        head = result.smoothed_losses[: max(1, len(result.smoothed_losses) // 10)]
        visible.extend([max(head), min(result.smoothed_losses), min(result.losses)])
    axes.set_xscale("log")
    axes.set_xlabel("learning rate (log scale)")
    axes.set_ylabel("training loss (faint: per step; solid: smoothed)")
    axes.grid(alpha=0.3)
    if visible:
        low, high = min(visible), max(visible)
        pad = 0.05 * (high - low) + 1e-3 * max(abs(high), 1.0)
        axes.set_ylim(low - pad, high + 3 * pad)
    axes.legend()
    axes.set_title(title if title is not None else f"LR range test; suggestion: {RULE}", fontsize=9)
    figure.savefig(path, dpi=120)
    plt.close(figure)
