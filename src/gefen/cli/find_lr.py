"""``gefen find-lr``: an LR range test of one optimizer on the demo model and data, with a recommended lr.

This module owns the command: its arguments, wiring the demo's model (``_model.py``), corpus and batches
(``_data.py``) and optimizer entries (``_optimizers.py``) into :func:`gefen.lr_finder.find_lr`, the progress
bar, the printed table, the JSON report and the plot. The ramp, smoothing, early stop and recommendation rule
are :mod:`gefen.lr_finder`'s.

What the run shares with ``gefen demo`` (so the finder sees what a demo run would): the model and its initial
weights (``--model-size``, ``--seed``), the training batches (``BatchSampler`` seeded with ``seed + 1``), the
optimizer entry (param groups, weight decay, betas) and gradient clipping to global L2 norm 1.0. What differs:
no warmup and no cosine schedule; the lr follows the exponential ramp from ``--lr-min`` to ``--lr-max`` over
``--steps`` updates. With ``--compare-adamw`` the same test runs for ``adamw`` from the same weights on the
same batches, and the ratio of the two recommendations is printed: the rule of thumb "this optimizer's lr =
ratio × AdamW's".

JSON report (``--json``): ``model_size``, ``model_params``, ``data`` (the corpus summary of ``gefen demo``),
``settings`` (every argument that shapes the run), ``results`` (optimizer name -> :meth:`LRFinderResult.to_dict`
plus ``demo_lr``, the demo's recommended lr from ``docs/lr_sweep.md``), ``ratio_to_adamw`` (suggested lr of
``--optimizer`` / AdamW's; ``null`` without ``--compare-adamw`` or when either has no suggestion) and
``total_time_s``.

Exit codes: 0 with a recommendation for every optimizer run; 1 when a run gave no recommendation (the reason
is printed; JSON and plot are still written); 2 for a usage error; 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from gefen.cli._args import PIP_HINT, add_model_and_data_arguments, output_problem

__all__ = ["add_parser", "run"]

_CLIP_NORM = 1.0
_DEFAULT_ROWS = 16
#: Demo entries the ramp cannot test, and why.
_UNSUPPORTED = {
    "adafactor": "its weight decay is set to 0.1 x 1e-3 / lr when it is built (at --lr-min), so the ramp's larger "
    "lrs would shrink the weights by lr x wd >= 1 per step",
}
_UNSUPPORTED_HELP = "; ".join(f"not {name}: {why}" for name, why in _UNSUPPORTED.items())
#: Arguments copied into the JSON report's ``settings``.
_SETTINGS = (
    "optimizer",
    "lr_min",
    "lr_max",
    "steps",
    "smoothing",
    "diverge_factor",
    "batch_size",
    "seq_len",
    "seed",
    "compare_adamw",
)


class _UsageError(Exception):
    """A bad argument or unusable data; reported as ``gefen find-lr: error: ...`` with exit code 2."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``find-lr`` on the top-level sub-parsers and return its parser.

    Args:
        subparsers: the object returned by ``ArgumentParser.add_subparsers()``.

    Returns:
        the ``find-lr`` parser; ``args.func`` is set to :func:`run`.
    """
    from gefen.cli._optimizers import OPTIMIZERS

    parser = subparsers.add_parser(
        "find-lr",
        help="LR range test on the demo model: loss against an exponentially growing lr, and a recommended lr",
        description=(
            "Train a copy of the demo model with one optimizer while the lr grows exponentially from --lr-min "
            "to --lr-max, print and plot the loss against the lr, and recommend an lr by the rule of "
            "gefen.lr_finder.RULE (printed with the result; docs/find_lr.md). --compare-adamw runs AdamW on the same "
            "weights and batches and prints the ratio."
        ),
    )
    add = parser.add_argument
    add(
        "--optimizer",
        choices=[name for name in OPTIMIZERS if name not in _UNSUPPORTED],
        default="gefen",
        help=f"the optimizer to test, as in gefen demo (default: %(default)s); {_UNSUPPORTED_HELP}",
    )
    add("--lr-min", type=float, default=1e-6, help="lr of the first update (default: %(default)g)")
    add("--lr-max", type=float, default=1.0, help="lr of the last update (default: %(default)g)")
    add("--steps", type=int, default=100, help="updates in the ramp, one batch each (default: %(default)s)")
    add(
        "--smoothing",
        type=float,
        default=0.9,
        help="EMA coefficient of the smoothed loss, in [0, 1) (default: %(default)s)",
    )
    add(
        "--diverge-factor",
        type=float,
        default=4.0,
        help="stop when the smoothed loss exceeds this multiple of its minimum (default: %(default)s)",
    )
    add(
        "--compare-adamw",
        action="store_true",
        help="also run adamw on the same weights and batches and print the ratio of the recommendations",
    )
    add_model_and_data_arguments(parser)
    add("--threads", type=int, default=None, help="torch threads (default: torch's current setting)")
    add("--rows", type=int, default=_DEFAULT_ROWS, help="rows of the printed lr table (default: %(default)s)")
    add("--json", default=None, metavar="PATH", help="write the curves and recommendations as JSON here")
    add(
        "--plot",
        default=None,
        metavar="PATH",
        help=f"write a PNG of loss against lr (log axis) here (needs {PIP_HINT})",
    )
    parser.set_defaults(func=run)
    return parser


def _check_args(args: argparse.Namespace) -> None:
    counts = (("--batch-size", args.batch_size), ("--seq-len", args.seq_len), ("--rows", args.rows))
    for flag, value in counts:
        if value < 1:
            raise _UsageError(f"{flag}={value} must be >= 1.")
    if args.threads is not None and args.threads < 1:
        raise _UsageError(f"--threads={args.threads} must be >= 1.")
    if args.steps < 5:
        raise _UsageError(f"--steps={args.steps} must be >= 5; the ramp needs a few points per decade, e.g. 100.")
    for flag, value in (("--lr-min", args.lr_min), ("--lr-max", args.lr_max)):
        if not math.isfinite(value) or value <= 0:
            raise _UsageError(f"{flag}={value:g} must be a finite number > 0.")
    if not args.lr_min < args.lr_max:
        raise _UsageError(f"--lr-min={args.lr_min:g} must be < --lr-max={args.lr_max:g}.")
    if not 0.0 <= args.smoothing < 1.0:
        raise _UsageError(f"--smoothing={args.smoothing:g} must be in [0, 1), e.g. 0.9.")
    if not math.isfinite(args.diverge_factor) or args.diverge_factor <= 1.0:
        raise _UsageError(f"--diverge-factor={args.diverge_factor:g} must be a finite number > 1, e.g. 4.")
    if args.compare_adamw and args.optimizer == "adamw":
        raise _UsageError("--compare-adamw with --optimizer adamw compares AdamW with itself; pick another optimizer.")
    problem = output_problem("gefen find-lr", {"--json": args.json, "--plot": args.plot}, args.plot, progress=True)
    if problem is not None:
        raise _UsageError(problem)


def run(args: argparse.Namespace) -> int:
    """Execute ``gefen find-lr`` with parsed arguments.

    Args:
        args: the namespace from the ``find-lr`` parser (see :func:`add_parser`).

    Returns:
        0 when every run gave a recommendation; 1 when one did not; 2 for a bad argument or unusable data
        (message on stderr); 130 on Ctrl-C.
    """
    import torch

    threads = torch.get_num_threads()
    try:
        return _run(args)
    except _UsageError as error:
        print(f"gefen find-lr: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ngefen find-lr: interrupted", file=sys.stderr)
        return 130
    finally:
        torch.set_num_threads(threads)  # the command may run in-process (tests); leave the setting as found


def _format_table(result: Any, rows: int) -> str:
    """``rows`` evenly spaced points of the curve (always the first, last and suggested ones) as a text table."""
    count = len(result.lrs)
    picks = {round(i * (count - 1) / max(1, rows - 1)) for i in range(rows)} if count else set()
    marked = result.lrs.index(result.suggested_lr) if result.suggested_lr is not None else None
    if marked is not None:
        picks.add(marked)
    lines = [f"{'step':>5}  {'lr':>9}  {'loss':>8}  {'smoothed':>8}", f"{'-' * 5}  {'-' * 9}  {'-' * 8}  {'-' * 8}"]
    for i in sorted(picks):
        note = "  <- suggested" if i == marked else ""
        lines.append(
            f"{i:>5}  {result.lrs[i]:>9.3g}  {result.losses[i]:>8.4f}  {result.smoothed_losses[i]:>8.4f}{note}"
        )
    return "\n".join(lines)


def _describe_stop(result: Any) -> str:
    if result.stop_reason == "diverged":
        factor = result.settings["diverge_factor"]
        return f"stopped at lr {result.stopped_at_lr:.3g}: smoothed loss above {factor:g}x its minimum"
    if result.stop_reason == "nonfinite_loss":
        return f"stopped at lr {result.stopped_at_lr:.3g}: the loss was NaN/Inf"
    if result.stop_reason == "batches_exhausted":
        return "stopped: out of batches"
    return "ran every step"


def _run(args: argparse.Namespace) -> int:
    wall_start = time.perf_counter()
    _check_args(args)
    import torch
    from tqdm import tqdm

    from gefen.cli._data import BatchSampler, check_fits, load_corpus
    from gefen.cli._model import build_model
    from gefen.cli._optimizers import OPTIMIZERS, describe
    from gefen.lr_finder import find_lr, plot_lr_curves

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        corpus = load_corpus(args.data)
        check_fits(corpus, args.seq_len)
    except (OSError, ValueError) as error:
        raise _UsageError(str(error)) from None
    data = corpus.describe()
    model = build_model(args.model_size, args.seq_len, args.seed)
    model_params = sum(p.numel() for p in model.parameters())
    ratio_per_step = (args.lr_max / args.lr_min) ** (1 / (args.steps - 1))
    print(
        f"gefen find-lr: model {args.model_size} ({model_params / 1e6:.2f}M params, context {args.seq_len}), "
        f"seed {args.seed}, {torch.get_num_threads()} thread(s); batches of {args.batch_size} x {args.seq_len} bytes\n"
        f"data: {data['source']}: {data['n_files']} files, train {data['train_bytes']:,} bytes\n"
        f"ramp: lr {args.lr_min:g} -> {args.lr_max:g} over {args.steps} updates (x{ratio_per_step:.4g} per update), "
        f"no schedule; grad clip {_CLIP_NORM:g}; smoothing {args.smoothing:g}; stop at "
        f"{args.diverge_factor:g}x the best smoothed loss",
        flush=True,
    )
    names = [args.optimizer, "adamw"] if args.compare_adamw else [args.optimizer]
    results = {}
    for name in names:
        print(f"[{name}] {describe(name, OPTIMIZERS[name].lr)}", flush=True)
        sampler = BatchSampler(corpus.train, args.batch_size, args.seq_len, seed=args.seed + 1)
        bar = tqdm(total=args.steps, desc=f"{name:>17}", file=sys.stderr, mininterval=0.5, dynamic_ncols=True)

        def advance(step: int, lr: float, loss: float, bar: Any = bar) -> None:
            bar.set_postfix_str(f"lr {lr:.2e} loss {loss:.3f}", refresh=False)
            bar.update(1)

        try:
            results[name] = find_lr(
                model,
                OPTIMIZERS[name].factory,
                (sampler.next() for _ in range(args.steps)),
                lambda trial, batch: trial.loss(batch),
                lr_min=args.lr_min,
                lr_max=args.lr_max,
                steps=args.steps,
                smoothing=args.smoothing,
                diverge_factor=args.diverge_factor,
                max_grad_norm=_CLIP_NORM,
                progress=advance,
                label=name,
            )
        finally:
            bar.close()
    for name, result in results.items():
        print(f"\n[{name}] loss (nats/byte) against lr; {_describe_stop(result)}; {result.elapsed_s:.1f} s")
        print(_format_table(result, args.rows))
        if result.suggested_lr is None:
            print(f"[{name}] no recommendation: {result.reason}")
        else:
            print(
                f"[{name}] suggested lr {result.suggested_lr:.3g} ({result.reason}); "
                f"gefen demo uses {OPTIMIZERS[name].lr:g}"
            )
    ratio = _ratio(results, args.optimizer)
    if ratio is not None:
        print(
            f"\nratio {args.optimizer} / adamw: {ratio:.3g} (suggested {results[args.optimizer].suggested_lr:.3g} "
            f"vs {results['adamw'].suggested_lr:.3g}): start {args.optimizer} at about {ratio:.2g}x the lr tuned "
            f"for AdamW"
        )
    total_time_s = time.perf_counter() - wall_start
    if args.json is not None:
        report = {
            "model_size": args.model_size,
            "model_params": model_params,
            "data": data,
            "settings": {key: getattr(args, key) for key in _SETTINGS}
            | {"max_grad_norm": _CLIP_NORM, "threads": torch.get_num_threads()},
            "results": {name: result.to_dict() | {"demo_lr": OPTIMIZERS[name].lr} for name, result in results.items()},
            "ratio_to_adamw": ratio,
            "total_time_s": total_time_s,
        }
        Path(args.json).write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")
        print(f"wrote {args.json}")
    if args.plot is not None:
        title = (
            f"gefen find-lr: {args.model_size} byte transformer ({model_params / 1e6:.2f}M params), "
            f"{args.steps} updates x {args.batch_size} x {args.seq_len} bytes, seed {args.seed}"
        )
        plot_lr_curves(results, args.plot, title=title)
        print(f"wrote {args.plot}")
    print(f"total wall time {total_time_s:.1f} s")
    return 0 if all(result.suggested_lr is not None for result in results.values()) else 1


def _ratio(results: dict[str, Any], name: str) -> float | None:
    if "adamw" not in results or name == "adamw":
        return None
    mine, adamw = results[name].suggested_lr, results["adamw"].suggested_lr
    return None if mine is None or adamw is None else mine / adamw
