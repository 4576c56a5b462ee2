"""``gefen inspect``: validate a saved optimizer checkpoint without the model, and summarise what it holds.

This module owns the command: its arguments, finding and reading the file, the text and JSON reports, and the
codebook plot. The validation itself is :mod:`gefen.inspect` (which calls :mod:`gefen.checkpoint`, the one
owner of the schema).

``CHECKPOINT`` is a file written by ``torch.save(optimizer.state_dict(), path)`` or a Hugging Face Trainer
checkpoint folder (``checkpoint-N/``, whose ``optimizer.pt`` is read). It is read with
``torch.load(weights_only=True, map_location="cpu")``, like a resume would.

Reported (the JSON keys carry units): optimizer kind (and a hybrid's backup), schema version saved and current,
deterministic policy (``"untagged"`` for schema 1), global step, parameters with state and param groups, the
histogram of block periods (period -> parameters), of second-moment kinds (kind -> parameters), the optimizer
state in bytes (every state tensor plus the 256 × 4-byte codebook) and per parameter element, and every problem
that would make ``load_state_dict`` refuse it.

Exit codes: 0 when it would load; 1 when any problem was found (``REFUSED: N problem(s)``); 2 for a usage error
(missing file, a folder without ``optimizer.pt``, a ``--plot`` folder that does not exist, matplotlib missing).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gefen.cli._args import PIP_HINT, output_problem

if TYPE_CHECKING:  # torch-backed; imported where used, so that `gefen --help` loads no torch
    from gefen.inspect import CheckpointReport, HalfReport

__all__ = ["add_parser", "run", "report_json", "report_text", "TRAINER_OPTIMIZER_FILE"]

#: File name of the optimizer state inside a Hugging Face Trainer checkpoint folder.
TRAINER_OPTIMIZER_FILE = "optimizer.pt"


class _UsageError(Exception):
    """A bad argument; reported as ``gefen inspect: error: ...`` with exit code 2."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``inspect`` on the top-level sub-parsers and return its parser.

    Args:
        subparsers: the object returned by ``ArgumentParser.add_subparsers()``.

    Returns:
        the ``inspect`` parser; ``args.func`` is set to :func:`run`.
    """
    parser = subparsers.add_parser(
        "inspect",
        help="validate a saved optimizer checkpoint offline and summarise it",
        description=(
            "Validate a Gefen, GefenMuon or GefenMuonHybrid checkpoint without the model (shapes are inferred "
            "from the saved state) with the same checks as load_state_dict, and report its schema version, "
            "policy, global step, periods, second-moment kinds and state bytes/param. Exit code 0: it would "
            "load; 1: problems found; 2: usage error."
        ),
    )
    parser.add_argument(
        "checkpoint",
        metavar="CHECKPOINT",
        help=(
            "file saved with torch.save(optimizer.state_dict(), path), or a Hugging Face Trainer checkpoint folder "
            f"holding {TRAINER_OPTIMIZER_FILE}"
        ),
    )
    parser.add_argument(
        "--plot",
        default=None,
        metavar="PNG",
        help=f"write a PNG of the 256 codebook values and their spacing here (needs {PIP_HINT})",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the text report")
    parser.set_defaults(func=run)
    return parser


def _resolve(path_text: str) -> Path:
    """The file to read: ``path_text`` itself, or ``optimizer.pt`` inside a folder."""
    path = Path(path_text)
    if not path.exists():
        raise _UsageError(f"{path_text!r} does not exist.")
    if path.is_dir():
        inner = path / TRAINER_OPTIMIZER_FILE
        if inner.is_dir():
            raise _UsageError(f"{str(inner)!r} is a folder, not a file written by torch.save.")
        if not inner.is_file():
            found = sorted(p.name for p in path.iterdir())[:10]
            raise _UsageError(
                f"folder {path_text!r} has no {TRAINER_OPTIMIZER_FILE} (it holds: {', '.join(found) or 'nothing'}); "
                f"pass a Hugging Face Trainer checkpoint folder (checkpoint-N/) or the file written by "
                "torch.save(optimizer.state_dict(), path)."
            )
        return inner
    return path


def _check_plot(path_text: str | None) -> None:
    problem = output_problem("gefen inspect", {"--plot": path_text}, path_text, progress=False)
    if problem is not None:
        raise _UsageError(problem)


def _load(path: Path) -> CheckpointReport:
    """Read ``path`` as a resume would and inspect it; an unreadable file is a problem of the report."""
    import torch

    from gefen.inspect import CheckpointReport, inspect_state_dict

    try:
        state_dict = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as error:  # unpickling, a truncated zip, a non-weights-only object: all refusals
        return CheckpointReport(
            optimizer=None,
            problems=[
                f"cannot read {str(path)!r} with torch.load(weights_only=True): {type(error).__name__}: "
                f"{str(error).splitlines()[0] if str(error) else ''}"
            ],
        )
    wrapped = _OPTIMIZER_ENTRY in state_dict if isinstance(state_dict, dict) else False
    if wrapped and not ({"state", "param_groups", "muon", "backup"} & set(state_dict)):
        # a training checkpoint such as {"model": ..., "optimizer": opt.state_dict(), "epoch": 3}
        print(f"note: reading the {_OPTIMIZER_ENTRY!r} entry of {path}", file=sys.stderr)
        state_dict = state_dict[_OPTIMIZER_ENTRY]
    return inspect_state_dict(state_dict)


#: The entry holding the optimizer's state dict in a typical training checkpoint.
_OPTIMIZER_ENTRY = "optimizer"


# ---------------------------------------------------------------------------------------------- summaries
def _policy(half: HalfReport) -> Any:
    """The deterministic policy as reported: a bool, ``"untagged"`` (schema 1), or the raw / missing value."""
    if half.deterministic is None and half.saved_schema_version == 1:
        return "untagged"
    return half.deterministic


def _agreed(values: list[Any]) -> Any:
    """The common value of the Gefen halves, or ``None`` when they differ or there is none."""
    return values[0] if values and all(v == values[0] for v in values) else None


def _merge(counts: list[dict[Any, int]]) -> dict[Any, int]:
    total: dict[Any, int] = {}
    for count in counts:
        for key, n in count.items():
            total[key] = total.get(key, 0) + n
    return dict(sorted(total.items()))


def _skipped(report: CheckpointReport) -> Any:
    """Steps skipped for NaN/Inf gradients: a hybrid's own count, else the Gefen half's (``None``: unknown)."""
    if report.optimizer == "GefenMuonHybrid":
        return report.skipped_steps
    return _agreed([h.skipped_steps for h in report.halves if h.gefen_layout])


def _half_json(half: HalfReport) -> dict[str, Any]:
    return {
        "label": half.label,
        "optimizer": half.optimizer,
        "saved_schema_version": half.saved_schema_version,
        "deterministic": _policy(half),
        "global_step": half.global_step,
        "skipped_steps": half.skipped_steps,
        "n_groups": half.n_groups,
        "n_params_listed": half.n_params_listed,
        "n_params_with_state": half.n_params_with_state,
        "numel_with_state": half.numel_with_state,
        "periods": {str(p): n for p, n in half.periods.items()},
        "second_moment_kinds": dict(half.second_moment_kinds),
        "state_bytes": half.state_bytes,
        "state_bytes_per_param": half.state_bytes_per_param,
        "has_codebook": half.codebook is not None,
        "problems": list(half.problems),
    }


def report_json(report: CheckpointReport, checkpoint: Path | None, plot: str | None) -> dict[str, Any]:
    """The JSON report: totals over the halves, then one entry per half.

    ``saved_schema_version``, ``deterministic`` and ``global_step`` are the Gefen halves' common value
    (``None`` when they differ); ``skipped_steps`` (steps skipped for NaN/Inf gradients) is a hybrid's own count,
    else the Gefen half's; ``periods`` (keys: period as a string) and ``second_moment_kinds`` are summed;
    ``state_bytes`` is in bytes, ``state_bytes_per_param`` in bytes per parameter element (``None`` without state).
    """
    from gefen.checkpoint import SCHEMA_VERSION

    gefen_halves = [h for h in report.halves if h.gefen_layout]
    problems = report.all_problems
    return {
        "checkpoint": None if checkpoint is None else str(checkpoint),
        "optimizer": report.optimizer,
        "backup_optimizer": report.backup_optimizer,
        "current_schema_version": SCHEMA_VERSION,
        "saved_schema_version": _agreed([h.saved_schema_version for h in gefen_halves]),
        "deterministic": _agreed([_policy(h) for h in gefen_halves]),
        "global_step": _agreed([h.global_step for h in gefen_halves]),
        "skipped_steps": _skipped(report),
        "n_groups": sum(h.n_groups for h in report.halves),
        "n_params_with_state": sum(h.n_params_with_state for h in report.halves),
        "numel_with_state": report.numel_with_state,
        "periods": {str(p): n for p, n in _merge([h.periods for h in report.halves]).items()},
        "second_moment_kinds": _merge([h.second_moment_kinds for h in report.halves]),
        "state_bytes": report.state_bytes,
        "state_bytes_per_param": report.state_bytes_per_param,
        "halves": [_half_json(h) for h in report.halves],
        "plot": plot,
        "loadable": not problems,
        "problems": problems,
    }


def _histogram(counts: dict[Any, int]) -> str:
    return ", ".join(f"{key}: {n}" for key, n in counts.items()) or "none"


def _bytes_line(state_bytes: int, numel: int, per_param: float | None) -> str:
    if per_param is None:
        return f"{state_bytes:,} B (no parameter state)"
    return f"{state_bytes:,} B = {per_param:.4f} B/param over {numel:,} parameter elements"


def _shown(value: Any) -> str:
    """A report value for the text report: strings other than ``"untagged"`` are raw saved values, so quoted."""
    if value is None:
        return "missing"
    return repr(value) if isinstance(value, str) and value != "untagged" else str(value)


def _half_lines(half: HalfReport, hybrid: bool = False) -> list[str]:
    from gefen.checkpoint import SCHEMA_VERSION

    rows: list[tuple[str, str]] = []
    if half.gefen_layout:
        rows += [
            ("schema version", f"saved {_shown(half.saved_schema_version)}, current {SCHEMA_VERSION}"),
            ("deterministic", _shown(_policy(half))),
            ("global step", _shown(half.global_step)),
        ]
        if not hybrid:  # a hybrid counts its skipped steps once, for both halves
            rows.append(("skipped steps", _shown(half.skipped_steps)))
    rows.append(
        (
            "params with state",
            f"{half.n_params_with_state} (of {half.n_params_listed} listed in {half.n_groups} param group(s))",
        )
    )
    if half.gefen_layout:
        codebook = "none"
        if half.codebook is not None:
            codebook = f"{tuple(half.codebook.shape)} {str(half.codebook.dtype).removeprefix('torch.')}"
        rows += [
            ("periods", _histogram(half.periods) + "  (period: params)"),
            ("second moments", _histogram(half.second_moment_kinds) + "  (kind: params)"),
            ("codebook", codebook),
        ]
    else:
        rows.append(("state", "torch.optim layout: counted, not validated as a Gefen state"))
    rows.append(("state bytes", _bytes_line(half.state_bytes, half.numel_with_state, half.state_bytes_per_param)))
    width = max(len(name) for name, _ in rows) + 1
    return [f"  {(name + ':').ljust(width)} {value}" for name, value in rows]


def report_text(report: CheckpointReport, checkpoint: Path | None) -> str:
    """The plain-text report: header, one block per half, totals for a hybrid, then the verdict."""
    lines = [f"checkpoint: {checkpoint}"]
    kind = report.optimizer or "unknown (no Gefen metadata)"
    if report.backup_optimizer is not None:
        kind += f" (backup: {report.backup_optimizer})"
    lines.append(f"optimizer: {kind}")
    hybrid = report.optimizer == "GefenMuonHybrid"
    if hybrid:
        lines.append(f"skipped steps (NaN/Inf gradients, both halves): {_shown(report.skipped_steps)}")
    for half in report.halves:
        if hybrid:
            lines.append(f"[{half.label}] {half.optimizer}")
        lines += _half_lines(half, hybrid)
    if hybrid:
        lines.append(
            "total state: " + _bytes_line(report.state_bytes, report.numel_with_state, report.state_bytes_per_param)
        )
    problems = report.all_problems
    if problems:
        lines.append("problems:")
        lines += [f"  - {problem}" for problem in problems]
        lines.append(f"REFUSED: {len(problems)} problem(s)")
    else:
        lines.append("OK: no problems found; it would load into an optimizer over parameters of these shapes.")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- plot
def _write_plot(path: str, report: CheckpointReport, title: str) -> bool:
    """Write a PNG with, per codebook, its values against index and a histogram of neighbour spacing.

    Returns:
        ``False`` (nothing written) when no half has a 1-D floating codebook.
    """
    codebooks = [
        (
            half.optimizer if half.label == "optimizer" else f"{half.label} half ({half.optimizer})",
            half.codebook.detach().float().cpu(),
        )
        for half in report.halves
        if half.codebook is not None and half.codebook.dim() == 1 and half.codebook.numel() >= 2
    ]
    if not codebooks:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (value_axes, gap_axes) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    for index, (label, codebook) in enumerate(codebooks):
        color = f"C{index}"
        value_axes.plot(range(codebook.numel()), codebook.tolist(), ".-", color=color, markersize=2, label=label)
        gaps = (codebook[1:] - codebook[:-1]).tolist()
        gap_axes.hist(gaps, bins=50, color=color, alpha=0.6, label=label)
    value_axes.set_xlabel("code (index)")
    value_axes.set_ylabel("codebook value (fraction of the block magnitude)")
    value_axes.set_title("codebook values")
    gap_axes.set_xlabel("spacing between neighbouring values")
    gap_axes.set_ylabel("count")
    gap_axes.set_title("spacing histogram")
    for axes in (value_axes, gap_axes):
        axes.grid(alpha=0.3)
        axes.legend()
    figure.suptitle(title, fontsize=10)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def run(args: argparse.Namespace) -> int:
    """Execute ``gefen inspect`` with parsed arguments.

    Args:
        args: the namespace from the ``inspect`` parser (see :func:`add_parser`).

    Returns:
        0 when the checkpoint would load; 1 when problems were found (listed in the report); 2 for a usage error
        (message on stderr).
    """
    try:
        checkpoint = _resolve(args.checkpoint)
        _check_plot(args.plot)
    except _UsageError as error:
        print(f"gefen inspect: error: {error}", file=sys.stderr)
        return 2
    report = _load(checkpoint)
    notes = sys.stderr if args.json else sys.stdout
    plot_written: str | None = None
    if args.plot is not None:
        if _write_plot(args.plot, report, f"gefen inspect: {checkpoint} ({report.optimizer or 'unknown'})"):
            plot_written = args.plot
        else:
            print(f"no codebook in {checkpoint} (no step ran, or it was removed): --plot wrote nothing.", file=notes)
    if args.json:
        print(json.dumps(report_json(report, checkpoint, plot_written), indent=1))
    else:
        print(report_text(report, checkpoint))
    if plot_written is not None:
        print(f"wrote {plot_written}", file=notes)
    return 1 if report.all_problems else 0
