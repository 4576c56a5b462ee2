"""``gefen demo``: train the same small byte-level transformer with several optimizers and compare them.

This module owns the command: its arguments, the per-optimizer training run, the results table, the JSON
report and the plot. The model is in ``_model.py``, the corpus and batches in ``_data.py``, the optimizer
entries (recommended lr, weight-decay policy, state accounting) in ``_optimizers.py``.

What every optimizer shares, so that only the update rule differs:

* the initial weights (``torch.manual_seed(seed)`` before building the model);
* the training batches (a private ``torch.Generator`` seeded with ``seed + 1``) and the fixed eval windows;
* the LR schedule: linear warmup over ``max(1, steps // 10)`` steps from ``peak/warmup`` to the peak lr,
  then cosine decay to ``0.1 × peak`` at the last step (``torch.optim.lr_scheduler.LambdaLR``);
* gradient clipping to global L2 norm 1.0 (``torch.nn.utils.clip_grad_norm_``) before every step.

Each optimizer trains in its own fresh process (``multiprocessing`` spawn context), so peak RSS
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``) and timings belong to that optimizer alone; the number
of torch threads is set from ``--threads`` in each.

Reported per optimizer (the JSON keys carry units):

* ``eval_loss``: mean next-byte cross-entropy (nats/byte) on the fixed eval windows after the last step;
* ``train_loss``: mean training loss over the last ``max(1, steps // 10)`` steps;
* ``state_bytes_per_param``: optimizer state bytes after training divided by the model's parameter count;
* ``opt_step_time_s``: median over steps of ``time.perf_counter()`` around ``optimizer.step()`` alone;
* ``train_step_time_s``: median of forward + backward + clip + ``step()`` + ``zero_grad()``;
* ``peak_rss_bytes``: peak resident set size of that optimizer's process (-1 where the ``resource`` module
  is missing, i.e. Windows);
* ``compile_time_s``: seconds spent compiling fused step kernels (``gefen``'s default path; 0 for the others
  and with ``GEFEN_FUSED=0``), part of the first ``step()``;
* ``total_time_s``: wall time of that optimizer's whole training and evaluation loop, compilation included;
* ``load_average_1min_before`` / ``load_average_1min_after``: the machine's 1-minute load average
  (``os.getloadavg()``, runnable threads of every process) just before and just after that optimizer's run
  (``null`` where the platform has none);
* ``eval_curve`` / ``train_curve``: ``[[step, loss], ...]``; eval at step 0, every ``--eval-every`` steps
  and at the last step; train at every step (the loss of the batch before that step's update).

The report's ``start_up`` entry times the wait before training: ``seconds`` from the launch to the first
optimizer's first training step (set-up, imports, corpus, model, process spawn, the step-0 eval), and ``since``,
what the launch is: ``scripts/demo.sh`` exports :data:`LAUNCH_ENV` (``date +%s.%N``) before its set-up, so a run
through the script counts from the script's start; otherwise it counts from the start of the ``gefen`` process
(Linux ``/proc``); ``null`` where neither is known.

A run whose training loss becomes non-finite stops there; its losses are reported as NaN (``null`` in JSON).

The optimizers run one after another, not interleaved: other processes' load during one run slows that run
only. The table says so, and the command warns, naming the run, when the load average before or after a run
exceeded the machine's cores by more than :data:`_BUSY_MARGIN` (its step times are then not comparable).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import multiprocessing
import os
import re
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gefen.cli._args import PIP_HINT, add_model_and_data_arguments, default_threads, output_problem

__all__ = ["add_parser", "run"]

#: Windows in the fixed eval set (each ``seq_len + 1`` bytes): 64 × 128 ≈ 8 K bytes at the defaults.
_EVAL_WINDOWS = 64
_EVAL_CHUNK = 32
_CLIP_NORM = 1.0
_MIN_LR_RATIO = 0.1
_DEFAULT_OPTIMIZERS = "adamw,gefen"
#: A run counts as disturbed when the 1-minute load average passed the machine's cores by more than this (the run's
#: own threads count in it, so a run with as many threads as cores on an idle machine stays at about the cores).
_BUSY_MARGIN = 0.5
#: ``[step, loss]`` pairs as ``json.dumps(indent=1)`` spreads them over four lines; folded back onto one.
_CURVE_POINT = re.compile(r"\[\s+(\d+),\s+([^\s\[\]]+)\s+\]")
#: Set by ``scripts/demo.sh`` to the Unix time (seconds, ``date +%s.%N``) at which the script started.
LAUNCH_ENV = "GEFEN_DEMO_LAUNCHED_AT"


class _UsageError(Exception):
    """A bad argument or unusable data; reported as ``gefen demo: error: ...`` with exit code 2."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``demo`` on the top-level sub-parsers and return its parser.

    Args:
        subparsers: the object returned by ``ArgumentParser.add_subparsers()``.

    Returns:
        the ``demo`` parser; ``args.func`` is set to :func:`run`.
    """
    from gefen.cli._optimizers import OPTIMIZERS

    names = ", ".join(f"{name} (lr {spec.lr:g})" for name, spec in OPTIMIZERS.items())
    parser = subparsers.add_parser(
        "demo",
        help="train a small byte-level transformer with several optimizers and compare them",
        description=(
            "Train the same small byte-level transformer (default corpus: the Python standard library's "
            "own .py files) from the same initial weights on the same batches with each optimizer, each in "
            "its own process, then print eval/train loss, optimizer state bytes/param, step times and peak "
            f"RSS. Known optimizers: {names}."
        ),
    )
    add = parser.add_argument
    add(
        "--optimizers",
        default=_DEFAULT_OPTIMIZERS,
        help="comma-separated optimizer names, run in this order (default: %(default)s)",
    )
    add(
        "--lr",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override one optimizer's peak lr (repeatable), e.g. --lr adamw=2e-3",
    )
    add("--steps", type=int, default=200, help="training steps per optimizer (default: %(default)s)")
    add_model_and_data_arguments(parser)
    add(
        "--threads",
        type=int,
        default=default_threads(),
        help="torch threads in each training process (default: all usable cores, %(default)s)",
    )
    add("--eval-every", type=int, default=25, help="evaluate every this many steps (default: %(default)s)")
    add("--json", default=None, metavar="PATH", help="write the results as JSON here")
    add(
        "--plot",
        default=None,
        metavar="PATH",
        help=f"write a PNG of eval and train loss against step here (needs {PIP_HINT})",
    )
    parser.set_defaults(func=run)
    return parser


@dataclass(frozen=True)
class _Job:
    """Everything one training process needs (pickled to the spawned child)."""

    name: str
    lr: float
    model_size: str
    seq_len: int
    batch_size: int
    steps: int
    seed: int
    threads: int
    eval_every: int
    train_bytes: bytes
    eval_bytes: bytes
    #: ``factory(model, lr)`` to use instead of ``OPTIMIZERS[name].factory`` (``benchmarks/muon_ablation.py``'s
    #: configurations); a module-level callable, so the job pickles into the spawned child.
    factory: Callable[[Any, float], Any] | None = None


def _parse_optimizers(text: str, known: Sequence[str]) -> list[str]:
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise _UsageError(f"--optimizers {text!r} has an empty name; pass e.g. --optimizers adamw,gefen.")
    unknown = [name for name in names if name not in known]
    if unknown:
        raise _UsageError(f"unknown optimizer(s) {', '.join(map(repr, unknown))}; valid names: {', '.join(known)}.")
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise _UsageError(f"--optimizers names {', '.join(duplicates)} more than once; list each optimizer once.")
    return names


def _parse_lrs(items: Sequence[str], selected: Sequence[str], known: Sequence[str]) -> dict[str, float]:
    overrides: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise _UsageError(f"--lr {item!r} is malformed; use NAME=VALUE, e.g. --lr adamw=2e-3.")
        if name not in known:
            raise _UsageError(f"--lr {item!r}: unknown optimizer {name!r}; valid names: {', '.join(known)}.")
        if name not in selected:
            raise _UsageError(
                f"--lr {item!r}: {name!r} is not in --optimizers ({', '.join(selected)}); "
                f"add it there or drop the --lr."
            )
        try:
            lr = float(value)
        except ValueError:
            raise _UsageError(f"--lr {item!r}: {value!r} is not a number; use e.g. --lr {name}=2e-3.") from None
        if not math.isfinite(lr) or lr <= 0:
            raise _UsageError(f"--lr {item!r}: the lr must be finite and > 0.")
        if name in overrides:
            raise _UsageError(f"--lr gives {name!r} twice; pass one --lr per optimizer.")
        overrides[name] = lr
    return overrides


def _check_args(args: argparse.Namespace) -> None:
    counts = (
        ("--steps", args.steps),
        ("--batch-size", args.batch_size),
        ("--seq-len", args.seq_len),
        ("--threads", args.threads),
        ("--eval-every", args.eval_every),
    )
    for flag, value in counts:
        if value < 1:
            raise _UsageError(f"{flag}={value} must be >= 1.")
    problem = output_problem("gefen demo", {"--json": args.json, "--plot": args.plot}, args.plot, progress=True)
    if problem is not None:
        raise _UsageError(problem)


def _lr_multiplier(step: int, total_steps: int) -> float:
    """LR factor for ``LambdaLR`` at scheduler step ``step`` (0-based; the lr used by update ``step + 1``).

    Linear warmup ``(step + 1) / warmup_steps`` for ``warmup_steps = max(1, total_steps // 10)``, then
    cosine from 1 down to ``_MIN_LR_RATIO`` at the last update.
    """
    warmup_steps = max(1, total_steps // 10)
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step + 1 - warmup_steps) / max(1, total_steps - warmup_steps))
    return _MIN_LR_RATIO + (1 - _MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))


def _peak_rss_bytes() -> int:
    """Peak resident set size of this process in bytes, or -1 where ``resource`` does not exist (Windows)."""
    try:
        import resource
    except ImportError:
        return -1
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB, macOS bytes


def _train_one(job: _Job) -> dict[str, Any]:
    """Train one optimizer from scratch in this (fresh) process and return its measurements."""
    import torch
    from tqdm import tqdm

    from gefen.cli._data import BatchSampler, eval_windows
    from gefen.cli._model import build_model
    from gefen.cli._optimizers import OPTIMIZERS, state_bytes

    torch.set_num_threads(job.threads)
    model = build_model(job.model_size, job.seq_len, job.seed)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = (job.factory or OPTIMIZERS[job.name].factory)(model, job.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_multiplier(step, job.steps))
    train = torch.frombuffer(bytearray(job.train_bytes), dtype=torch.uint8)
    sampler = BatchSampler(train, job.batch_size, job.seq_len, seed=job.seed + 1)
    eval_data = torch.frombuffer(bytearray(job.eval_bytes), dtype=torch.uint8)
    eval_set = eval_windows(eval_data, job.seq_len, _EVAL_WINDOWS)

    @torch.no_grad()
    def evaluate() -> float:
        losses = [model.loss(chunk).item() * len(chunk) for chunk in eval_set.split(_EVAL_CHUNK)]
        return sum(losses) / len(eval_set)

    eval_curve: list[list[float]] = [[0, evaluate()]]
    train_curve: list[list[float]] = []
    opt_step_times: list[float] = []
    train_step_times: list[float] = []
    diverged_at: int | None = None
    params = list(model.parameters())
    first_step_unix_s = time.time()  # the wall clock, comparable with the parent's launch time
    start = time.perf_counter()
    bar = tqdm(total=job.steps, desc=f"{job.name:>13}", file=sys.stderr, mininterval=0.5, dynamic_ncols=True)
    for step in range(1, job.steps + 1):
        batch = sampler.next()
        t0 = time.perf_counter()
        loss = model.loss(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, _CLIP_NORM)
        t1 = time.perf_counter()
        optimizer.step()
        t2 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        scheduler.step()
        opt_step_times.append(t2 - t1)
        train_step_times.append(t3 - t0)
        loss_value = loss.item()
        train_curve.append([step, loss_value])
        if not math.isfinite(loss_value):
            diverged_at = step
            bar.write(f"gefen demo: {job.name}: training loss {loss_value} at step {step}; stopping the run.")
            break
        if step % job.eval_every == 0 or step == job.steps:
            eval_curve.append([step, evaluate()])
        bar.set_postfix_str(f"loss {loss_value:.3f} eval {eval_curve[-1][1]:.3f}", refresh=False)
        bar.update(1)
    bar.close()
    train_time_s = time.perf_counter() - start
    tail = train_curve[-max(1, job.steps // 10) :]
    nan = float("nan")
    return {
        "lr": job.lr,
        "eval_loss": nan if diverged_at else eval_curve[-1][1],
        "train_loss": nan if diverged_at else statistics.fmean(loss for _, loss in tail),
        "state_bytes_per_param": state_bytes(optimizer) / n_params,
        "opt_step_time_s": statistics.median(opt_step_times),
        "train_step_time_s": statistics.median(train_step_times),
        "peak_rss_bytes": _peak_rss_bytes(),
        "eval_curve": eval_curve,
        "train_curve": train_curve,
        "_model_params": n_params,
        "_diverged_at_step": diverged_at,
        "_train_time_s": train_time_s,
        "_first_opt_step_time_s": opt_step_times[0],
        "_first_step_unix_s": first_step_unix_s,
        "compile_time_s": float(getattr(optimizer, "compile_time_s", 0.0)),
        "total_time_s": train_time_s,
    }


def _load_average() -> float | None:
    """The machine's 1-minute load average (``os.getloadavg()[0]``), or ``None`` where the platform has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _busy_runs(results: dict[str, dict[str, Any]], cores: int) -> list[str]:
    """One warning line per run whose load average before or after it exceeded ``cores + _BUSY_MARGIN``.

    Args:
        results: per optimizer, its result with ``_load_before`` / ``_load_after`` (floats or ``None``).
        cores: the machine's CPU cores (``os.cpu_count()``; the load average counts every process on it).
    """
    lines = []
    for name, result in results.items():
        before, after = result["_load_before"], result["_load_after"]
        loads = [load for load in (before, after) if load is not None]
        if loads and max(loads) > cores + _BUSY_MARGIN:
            shown = " before, ".join("n/a" if load is None else f"{load:.2f}" for load in (before, after))
            lines.append(
                f"warning: the machine was busy during {name}'s run (1-minute load average {shown} after, on "
                f"{cores} core(s)): its step times are inflated by other processes and not comparable with the "
                "other runs'; rerun on a quiet machine to compare speed (losses and state bytes are unaffected)."
            )
    return lines


def _process_start_unix_s() -> float | None:
    """Unix time (s) at which this process started, from Linux ``/proc`` (10 ms ticks); ``None`` elsewhere.

    ``/proc/self/stat`` field 22 is the start in clock ticks after boot and ``/proc/uptime`` the seconds since
    boot now, so the start was ``uptime - ticks / SC_CLK_TCK`` seconds ago.
    """
    try:
        stat = Path("/proc/self/stat").read_text()
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
        now = time.time()
        ticks = int(stat[stat.rindex(")") + 2 :].split()[19])  # fields after "pid (comm)" start at field 3
        return now - (uptime_s - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _launch() -> tuple[float, str] | None:
    """The launch the start-up wait counts from: ``(unix time in s, what it is)``, or ``None`` if unknown.

    :data:`LAUNCH_ENV` (exported by ``scripts/demo.sh``) wins when it holds a number no later than now;
    otherwise the start of this process.
    """
    text = os.environ.get(LAUNCH_ENV, "")
    try:
        launched = float(text)
    except ValueError:  # unset, or a date without %N support (macOS prints a literal "N")
        launched = math.nan
    if math.isfinite(launched) and 0 < launched <= time.time():
        return launched, "scripts/demo.sh started"
    started = _process_start_unix_s()
    return None if started is None else (started, "the gefen process started")


def _warm_up() -> None:
    """Import what :func:`_train_one` needs, ``torch._dynamo`` included (the first optimizer built loads it)."""
    import tqdm  # noqa: F401

    import gefen.cli._data
    import gefen.cli._model  # noqa: F401
    from gefen.cli._optimizers import warm_up

    warm_up()


def _fresh_process() -> concurrent.futures.ProcessPoolExecutor:
    """A new spawned process (a one-worker pool) that starts its imports now (:func:`_warm_up`).

    Each optimizer trains in its own, so its RSS and timings are its own; started before the parent has the
    corpus ready, its imports (2-4 s) overlap the parent's work instead of following it.
    """
    pool = concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
    pool.submit(_warm_up)
    return pool


def _run_in_fresh_process(job: _Job, pool: concurrent.futures.ProcessPoolExecutor | None = None) -> dict[str, Any]:
    """Run :func:`_train_one` in ``pool`` (from :func:`_fresh_process`; a new one by default), then end it."""
    with pool or _fresh_process() as owned:
        return owned.submit(_train_one, job).result()


def _format_table(results: dict[str, dict[str, Any]]) -> str:
    header = [
        "optimizer",
        "lr",
        "eval loss",
        "train loss",
        "state B/param",
        "opt.step ms*",
        "train step ms*",
        "peak RSS MiB",
    ]
    baseline = results.get("adamw", {}).get("eval_loss")
    if baseline is not None and len(results) > 1:
        header.append("eval/adamw")
    rows = [header]
    for name, result in results.items():
        row = [
            name,
            f"{result['lr']:.3g}",
            "diverged" if result["_diverged_at_step"] else f"{result['eval_loss']:.4f}",
            "diverged" if result["_diverged_at_step"] else f"{result['train_loss']:.4f}",
            f"{result['state_bytes_per_param']:.3f}",
            f"{result['opt_step_time_s'] * 1e3:.2f}",
            f"{result['train_step_time_s'] * 1e3:.1f}",
            f"{result['peak_rss_bytes'] / 2**20:.0f}" if result["peak_rss_bytes"] >= 0 else "n/a",
        ]
        if len(header) > len(row):
            ratio = result["eval_loss"] / baseline
            row.append(f"{ratio:.4f}" if math.isfinite(ratio) else "n/a")
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(
            cell.ljust(width) if column == 0 else cell.rjust(width)
            for column, (cell, width) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _report(
    steps: int,
    model_params: int,
    data: dict[str, object],
    results: dict[str, dict[str, Any]],
    settings: dict[str, object] | None = None,
) -> dict[str, Any]:
    optimizers = {}
    for name, result in results.items():
        optimizers[name] = {
            "lr": float(result["lr"]),
            "eval_loss": _finite_or_none(result["eval_loss"]),
            "train_loss": _finite_or_none(result["train_loss"]),
            "state_bytes_per_param": float(result["state_bytes_per_param"]),
            "opt_step_time_s": float(result["opt_step_time_s"]),
            "train_step_time_s": float(result["train_step_time_s"]),
            "peak_rss_bytes": int(result["peak_rss_bytes"]),
            "compile_time_s": float(result.get("compile_time_s", 0.0)),
            "total_time_s": float(result.get("total_time_s", float("nan"))),
            "load_average_1min_before": result.get("_load_before"),
            "load_average_1min_after": result.get("_load_after"),
            "eval_curve": [[int(s), _finite_or_none(v)] for s, v in result["eval_curve"]],
            "train_curve": [[int(s), _finite_or_none(v)] for s, v in result["train_curve"]],
        }
    report: dict[str, Any] = {"steps": steps, "model_params": model_params, "data": data, "optimizers": optimizers}
    if settings is not None:
        report["settings"] = settings  # everything else needed to reproduce the run
    return report


def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over up to ``window`` points (plain Python, no numpy needed)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _write_plot(path: str, results: dict[str, dict[str, Any]], title: str) -> None:
    """Write a two-panel PNG (eval loss | smoothed train loss, against step) for every optimizer."""
    try:
        import matplotlib
    except ImportError:
        raise _UsageError(f"--plot needs matplotlib, which is not installed; run: {PIP_HINT}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (eval_axes, train_axes) = plt.subplots(1, 2, figsize=(12, 4.6), constrained_layout=True)
    visible: list[float] = []  # losses the zoomed y range must show
    for index, (name, result) in enumerate(results.items()):
        color = f"C{index}"
        steps, losses = zip(*result["eval_curve"], strict=True)
        label = f"{name} (lr {result['lr']:.3g})"
        eval_axes.plot(steps, losses, "o-", color=color, label=label, markersize=4)
        train_steps, train_losses = zip(*result["train_curve"], strict=True)
        window = max(1, len(train_losses) // 25)
        train_axes.plot(train_steps, train_losses, color=color, alpha=0.2, linewidth=0.8)
        smoothed = _smooth(list(train_losses), window)
        smoothing = f", mean of {window} steps" if window > 1 else ""
        train_axes.plot(train_steps, smoothed, color=color, label=f"{label}{smoothing}")
        finite = [v for v in losses[1:] + tuple(smoothed[len(smoothed) // 5 :]) if math.isfinite(v)]
        visible.extend(finite)
    for axes, name in ((eval_axes, "eval loss (held-out files)"), (train_axes, "train loss")):
        axes.set_xlabel("step")
        axes.set_ylabel(f"{name}, nats/byte")
        axes.grid(alpha=0.3)
        axes.legend()
    if visible:
        # The first evals sit near ln(256) ≈ 5.5; zoom on the part of the run where optimizers differ.
        ceiling = math.log(256) + 0.2  # a diverging curve goes off the top instead of squashing the rest
        low, high = min(visible), min(max(visible), ceiling)
        pad = 0.08 * max(high - low, 0.0) + 0.02
        for axes in (eval_axes, train_axes):
            axes.set_ylim(low - pad, min(high + 4 * pad, ceiling))
    initial_eval = next(iter(results.values()))["eval_curve"][0][1]  # same weights and windows for all
    eval_axes.set_title(f"eval loss (y zoomed; step 0: {initial_eval:.2f})")
    train_axes.set_title("train loss (faint: per step)")
    figure.suptitle(title, fontsize=10)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def run(args: argparse.Namespace) -> int:
    """Execute ``gefen demo`` with parsed arguments.

    Args:
        args: the namespace from the ``demo`` parser (see :func:`add_parser`).

    Returns:
        0 on success; 2 for a bad argument or unusable data (message on stderr); 1 when a training
        process failed (its traceback on stderr); 130 on Ctrl-C.
    """
    try:
        return _run(args)
    except _UsageError as error:
        print(f"gefen demo: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ngefen demo: interrupted", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace) -> int:
    wall_start = time.perf_counter()
    from gefen.cli._optimizers import OPTIMIZERS

    known = list(OPTIMIZERS)
    names = _parse_optimizers(args.optimizers, known)
    lr_overrides = _parse_lrs(args.lr, names, known)
    _check_args(args)
    first_pool = _fresh_process()  # the first optimizer's process imports while the corpus loads
    try:
        return _train_all(args, names, lr_overrides, first_pool, wall_start)
    finally:
        # Ran its job: already shut down. Else (a bad --data, Ctrl-C) the error shows now; the process ends after
        # its imports.
        first_pool.shutdown(wait=False, cancel_futures=True)


def _train_all(
    args: argparse.Namespace,
    names: list[str],
    lr_overrides: dict[str, float],
    first_pool: concurrent.futures.ProcessPoolExecutor,
    wall_start: float,
) -> int:
    """Load the corpus, train every optimizer in ``names`` (the first in ``first_pool``) and report."""
    from gefen.cli._data import check_fits, load_corpus
    from gefen.cli._model import build_model
    from gefen.cli._optimizers import OPTIMIZERS, describe

    launch = _launch()
    start_up: dict[str, Any] | None = None
    try:
        corpus = load_corpus(args.data)
        check_fits(corpus, args.seq_len)
    except (OSError, ValueError) as error:
        raise _UsageError(str(error)) from None
    data = corpus.describe()
    model_params = sum(p.numel() for p in build_model(args.model_size, args.seq_len, args.seed).parameters())
    print(
        f"gefen demo: model {args.model_size} ({model_params / 1e6:.2f}M params, byte vocab, "
        f"context {args.seq_len}), {args.steps} steps x {args.batch_size} x {args.seq_len} bytes, "
        f"seed {args.seed}, {args.threads} thread(s)\n"
        f"data: {data['source']}: {data['n_files']} files, train {data['train_bytes']:,} bytes, "
        f"eval {data['eval_bytes']:,} bytes ({data['held_out_rule']})\n"
        f"schedule: warmup {max(1, args.steps // 10)} steps, cosine to {_MIN_LR_RATIO:g}x peak; "
        f"grad clip {_CLIP_NORM:g}; eval on {_EVAL_WINDOWS} fixed windows every {args.eval_every} steps",
        flush=True,
    )
    results: dict[str, dict[str, Any]] = {}
    train_bytes, eval_bytes = corpus.train.numpy().tobytes(), corpus.eval.numpy().tobytes()
    for name in names:
        lr = lr_overrides.get(name, OPTIMIZERS[name].lr)
        print(f"[{name}] {describe(name, lr)}; lr {lr:g}{' (--lr)' if name in lr_overrides else ''}", flush=True)
        job = _Job(
            name=name,
            lr=lr,
            model_size=args.model_size,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            steps=args.steps,
            seed=args.seed,
            threads=args.threads,
            eval_every=args.eval_every,
            train_bytes=train_bytes,
            eval_bytes=eval_bytes,
        )
        started, load_before = time.perf_counter(), _load_average()
        try:
            results[name] = _run_in_fresh_process(job, first_pool if name == names[0] else None)
            results[name].update(_load_before=load_before, _load_after=_load_average())
        except Exception as error:  # the child's exception, re-raised here with its traceback attached
            traceback.print_exception(error, file=sys.stderr)
            print(f"gefen demo: error: training with {name!r} failed: {type(error).__name__}: {error}", file=sys.stderr)
            return 1
        print(
            f"[{name}] done in {time.perf_counter() - started:.1f} s ({results[name]['_train_time_s']:.1f} s "
            f"training and eval; first optimizer.step() {results[name]['_first_opt_step_time_s']:.2f} s, of which "
            f"{results[name]['compile_time_s']:.2f} s compiling)",
            flush=True,
        )
        if start_up is None and launch is not None:
            start_up = {"seconds": results[name]["_first_step_unix_s"] - launch[0], "since": launch[1]}
            print(
                f"[{name}] its first training step began {start_up['seconds']:.1f} s after {launch[1]} (set-up, "
                "imports, corpus, model, process spawn, step-0 eval)",
                flush=True,
            )
    print()
    print(_format_table(results))
    _print_ratios(results)
    for line in _busy_runs(results, os.cpu_count() or 1):
        print(line)
    if args.json is not None:
        settings = {
            key: getattr(args, key)
            for key in ("batch_size", "seq_len", "model_size", "seed", "threads", "eval_every")
            if hasattr(args, key)
        }
        report = _report(args.steps, model_params, data, results, settings)
        report["start_up"] = start_up
        Path(args.json).write_text(_CURVE_POINT.sub(r"[\1, \2]", json.dumps(report, indent=1)) + "\n")
        print(f"wrote {args.json}")
    if args.plot is not None:
        title = (
            f"gefen demo: {args.model_size} byte transformer ({model_params / 1e6:.2f}M params), "
            f"{args.steps} steps x {args.batch_size} x {args.seq_len} bytes, seed {args.seed}"
        )
        _write_plot(args.plot, results, title)
        print(f"wrote {args.plot}")
    print(f"total wall time {time.perf_counter() - wall_start:.1f} s")
    return 0


def _print_ratios(results: dict[str, dict[str, Any]]) -> None:
    print(
        "\neval loss: nats/byte on held-out files after the last step; train loss: mean of the last "
        "10% of steps; state B/param from optimizer state after training.\n"
        "* times are medians over steps, measured in sequential runs (one optimizer after another, each in its own "
        "process, not interleaved): load from other processes during one run slows that run only."
    )
    if "gefen" in results and "adamw" in results:
        ratio = results["gefen"]["eval_loss"] / results["adamw"]["eval_loss"]  # NaN if either diverged
        print(
            f"gefen/adamw eval-loss ratio: {ratio:.4f} "
            f"(state {results['gefen']['state_bytes_per_param']:.2f} vs "
            f"{results['adamw']['state_bytes_per_param']:.2f} bytes/param)"
        )
    for name, result in results.items():
        if result["_diverged_at_step"]:
            print(
                f"{name}: training loss became non-finite at step {result['_diverged_at_step']}; "
                f"try a lower --lr {name}=..."
            )
