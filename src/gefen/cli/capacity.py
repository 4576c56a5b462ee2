"""``gefen capacity``: the largest model each optimizer trains within a memory budget, found by measurement.

For each optimizer and budget, models of one GPT-shaped family (the demo's architecture scaled in width and depth:
:func:`gefen.cli._capacity_search.model_family`) are trained for a few full steps (forward, backward, optimizer
step, fp32 master weights), each in its own child process under the budget (:mod:`gefen.cli._capacity_probe`),
until the largest model that trains and the next one, which does not, are both measured. Nothing is extrapolated:
every parameter count in the report trained, and every peak was measured.

What counts against the budget: on the CPU the child process's peak resident set (Python, torch, the model, its
gradients, activations, the optimizer state and any temporaries; a child passing the budget is killed on the
spot), on CUDA the allocator's peak (``max_memory_allocated``; the allocator is capped at the budget).

Importable: :func:`measure_capacity` returns the report the command prints and writes as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gefen.cli._args import PIP_HINT, default_threads, output_problem
from gefen.cli._capacity_search import FamilyMember, Outcome, SearchResult, format_params, largest_fitting
from gefen.cli._capacity_search import round_down_budget as _round_down_budget

__all__ = ["add_parser", "default_budget_bytes", "measure_capacity", "run"]

GIB = 2**30
_CPU_SEQ, _CUDA_SEQ = 128, 1024


class _UsageError(Exception):
    """A bad argument; reported as ``gefen capacity: error: ...`` with exit code 2."""


def _cgroup_room_bytes() -> int | None:
    """Memory this process's cgroup may still take (its limit minus its usage), ``None`` without a limit."""
    pairs = (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),  # v1
    )
    for limit_path, usage_path in pairs:
        try:
            limit, usage = Path(limit_path).read_text().strip(), Path(usage_path).read_text().strip()
        except OSError:
            continue
        if limit.isdigit() and usage.isdigit() and int(limit) < 2**60:  # "max" or a huge v1 value: no limit
            return max(0, int(limit) - int(usage))
    return None


def _available_cpu_bytes() -> int | None:
    """Memory available to a new process now, bytes: ``MemAvailable`` capped by a container's memory limit,
    ``None`` where it cannot be read."""
    free = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except OSError:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            free = None
    room = _cgroup_room_bytes()
    if room is not None:
        free = room if free is None else min(free, room)
    return free


def default_budget_bytes(device: str) -> int:
    """The default budget in bytes: the GPU's total memory on CUDA; on the CPU 90 % of the memory available now
    (``MemAvailable``, capped by a container's memory limit), rounded down to 1/4 GiB.

    Raises:
        RuntimeError: the CPU's available memory cannot be read on this system (pass ``--budget-gib``).
    """
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    free = _available_cpu_bytes()
    if free is None:
        raise RuntimeError("cannot read this machine's available memory; pass --budget-gib.")
    return _round_down_budget(free)


def _member_record(outcome: Outcome) -> dict[str, Any]:
    member = outcome.member
    record: dict[str, Any] = {
        "params": member.params,
        "d_model": member.d_model,
        "n_layers": member.n_layers,
        "status": outcome.status,
        "peak_bytes": outcome.peak_bytes,
        "peak_gib": None if outcome.peak_bytes is None else round(outcome.peak_bytes / GIB, 4),
        "limit_gib": round(outcome.limit_bytes / GIB, 4),
        "steps": outcome.steps,
        "losses": [round(loss, 4) for loss in outcome.losses],
        "seconds": round(outcome.seconds, 2),
        "phase": outcome.phase,
    }
    if outcome.state_bytes is not None:
        record["state_bytes"] = outcome.state_bytes
        record["state_bytes_per_param"] = round(outcome.state_bytes / member.params, 4)
    if outcome.peak_bytes is not None and outcome.status == "fit":
        record["peak_bytes_per_param"] = round(outcome.peak_bytes / member.params, 3)
    if outcome.detail:
        record["detail"] = outcome.detail
    record.update({k: v for k, v in outcome.extra.items()})
    return record


def _complete(result: SearchResult) -> bool:
    """Whether the search answered: the largest fit and the next model, which did not fit, both measured (or
    the smallest model did not fit), with no run stopped for another reason."""
    if result.error is not None:
        return False
    if result.largest is None:
        return True  # the search ends without a fit only when the smallest model did not fit
    return result.next_larger is not None


def _budget_record(result: SearchResult) -> dict[str, Any]:
    return {
        "budget_gib": round(result.budget_bytes / GIB, 4),
        "budget_bytes": result.budget_bytes,
        "complete": _complete(result),
        "largest": None if result.largest is None else _member_record(result.largest),
        "next_larger": None if result.next_larger is None else _member_record(result.next_larger),
        "error": None if result.error is None else _member_record(result.error),
        "probes": result.probes,
    }


def measure_capacity(
    optimizers: Sequence[str],
    budgets_bytes: Sequence[int],
    device: str = "cpu",
    batch_size: int = 1,
    seq_len: int = _CPU_SEQ,
    steps: int = 3,
    threads: int | None = None,
    autocast: str = "none",
    checkpoint_activations: bool = False,
    probe_timeout_s: float = 1800.0,
    seed: int = 0,
    on_run: Callable[[str, FamilyMember, int, Outcome | None], None] | None = None,
) -> dict[str, Any]:
    """Find, by training, the largest model of the family each optimizer fits in each budget.

    Args:
        optimizers: names of :data:`gefen.cli._capacity_optimizers.CAPACITY_OPTIMIZERS`.
        budgets_bytes: memory budgets in bytes.
        device: ``"cpu"`` or ``"cuda"`` / ``"cuda:N"``.
        batch_size, seq_len: each step's batch (sequences of ``seq_len`` bytes).
        steps: training steps a model must complete (>= 1).
        threads: torch threads per child on the CPU (default: every usable core).
        autocast: ``"none"`` (fp32) or ``"bf16"`` (``torch.autocast``; weights stay fp32).
        checkpoint_activations: recompute each block's activations in backward.
        probe_timeout_s: a child still running after this many seconds is stopped and reported as a timeout.
        seed: model and data seed.
        on_run: called as ``on_run(optimizer, member, budget, None)`` before each training run and with its
            :class:`~gefen.cli._capacity_search.Outcome` after (progress display).

    Returns:
        the report (a JSON-serialisable dict): settings, per optimizer and budget the largest model that trained
        (params, shape, peak, optimizer-state bytes), the next larger model's run, the parameter ratio to
        ``adamw``, and every run made.

    Raises:
        KeyError: an unknown optimizer name.
    """
    from gefen.cli._capacity_optimizers import CAPACITY_OPTIMIZERS
    from gefen.cli._capacity_probe import ProbeSpec, run_probe

    threads = default_threads() if threads is None else threads
    start = time.perf_counter()
    results: dict[str, Any] = {}
    runs: list[dict[str, Any]] = []
    for name in optimizers:
        entry = CAPACITY_OPTIMIZERS[name]
        outcomes: list[Outcome] = []

        def probe(member: FamilyMember, budget: int, name: str = name) -> Outcome:
            spec = ProbeSpec(
                name, member.d_model, member.n_layers, member.d_ff, budget, device, batch_size, seq_len, steps,
                threads, autocast, checkpoint_activations, seed,
            )  # fmt: skip
            if on_run is not None:
                on_run(name, member, budget, None)
            outcome = run_probe(spec, member, probe_timeout_s)
            runs.append({"optimizer": name, "budget_gib": round(budget / GIB, 4), **_member_record(outcome)})
            if on_run is not None:
                on_run(name, member, budget, outcome)
            return outcome

        per_budget = [
            largest_fitting(probe, budget, outcomes, entry.prior_bytes_per_param) for budget in sorted(budgets_bytes)
        ]
        results[name] = {"description": entry.description, "budgets": [_budget_record(r) for r in per_budget]}
    _add_ratios(results)
    from gefen._version import __version__

    return {
        "command": "gefen capacity",
        "gefen": __version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": device,
        "device_name": _device_name(device),
        "torch": _torch_version(),
        "budgets_gib": [round(b / GIB, 4) for b in sorted(budgets_bytes)],
        "batch_size": batch_size,
        "seq_len": seq_len,
        "steps": steps,
        "threads": threads,
        "autocast": autocast,
        "checkpoint_activations": checkpoint_activations,
        "seed": seed,
        "probe_timeout_s": probe_timeout_s,
        "complete": all(b["complete"] for entry in results.values() for b in entry["budgets"]),
        "notes": (
            "Each budget's 'largest' trained all steps with its measured peak within the budget; 'next_larger' is the "
            "next model of the family, which did not fit. A run stopped at a limit ('phase' other than 'done') "
            "reached at least 'peak_bytes' (a lower bound). 'complete': false marks a search stopped by a run that "
            "failed for another reason (its 'error'); its 'largest' is then only a lower bound and has no ratio."
        ),
        "memory": "peak resident set of the training process (VmHWM)"
        if not device.startswith("cuda")
        else "torch.cuda.max_memory_allocated (allocator capped at the budget)",
        "results": results,
        "runs": runs,
        "total_time_s": round(time.perf_counter() - start, 1),
    }


def _add_ratios(results: dict[str, Any]) -> None:
    if "adamw" not in results:
        return
    base = {b["budget_bytes"]: b["largest"] for b in results["adamw"]["budgets"]}
    adamw_complete = {b["budget_bytes"]: b["complete"] for b in results["adamw"]["budgets"]}
    for entry in results.values():
        for budget in entry["budgets"]:
            adamw, ours = base.get(budget["budget_bytes"]), budget["largest"]
            answered = budget["complete"] and adamw_complete.get(budget["budget_bytes"], False)
            budget["params_vs_adamw"] = (
                round(ours["params"] / adamw["params"], 3)
                if answered and adamw is not None and ours is not None
                else None
            )


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return str(torch.cuda.get_device_name(torch.device(device)))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {default_threads()} cores"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def format_table(report: dict[str, Any]) -> str:
    """The report as a text table: one row per optimizer and budget."""
    header = ["optimizer", "budget GiB", "largest trained", "peak GiB", "state B/param", "vs AdamW", "next size up"]
    rows = [header]
    for name, entry in report["results"].items():
        for budget in entry["budgets"]:
            largest, above = budget["largest"], budget["next_larger"]
            if largest is None:
                error = budget["error"]
                first = "nothing fits" if error is None else f"stopped: {error.get('detail', error['status'])}"
                rows.append([name, f"{budget['budget_gib']:g}", first, "", "", "", ""])
                continue
            label = f"{format_params(largest['params'])} (d={largest['d_model']}, L={largest['n_layers']})"
            if not budget["complete"]:
                label = f">= {label}, search stopped"
            ratio = budget.get("params_vs_adamw")
            if budget["error"] is not None:
                nxt = f"{format_params(budget['error']['params'])}: {budget['error'].get('detail', '')}"
            elif above is not None:
                exact = above.get("phase") == "done"
                peak = above.get("peak_gib")
                peak = "" if peak is None else (f", {peak:.2f} GiB" if exact else f", > {above['limit_gib']:g} GiB")
                nxt = f"{format_params(above['params'])}: {above['status'].replace('_', ' ')}{peak}"
            else:
                nxt = "not measured"
            rows.append([
                name,
                f"{budget['budget_gib']:g}",
                label,
                f"{largest['peak_gib']:.2f}",
                f"{largest.get('state_bytes_per_param', float('nan')):.2f}",
                "" if ratio is None else f"{ratio:.2f}x",
                nxt,
            ])  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def write_plot(path: str, report: dict[str, Any]) -> None:
    """A PNG of the largest model trained against the budget, one line per optimizer, labelled with its size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    for name, entry in report["results"].items():
        points = [(b["budget_gib"], b["largest"]["params"]) for b in entry["budgets"] if b["largest"] is not None]
        if points:
            xs, ys = zip(*points)
            axes.plot(xs, [y / 1e6 for y in ys], marker="o", label=name)
            axes.annotate(format_params(ys[-1]), (xs[-1], ys[-1] / 1e6), textcoords="offset points", xytext=(4, 0),
                          fontsize=8, va="center")  # fmt: skip
    axes.set_ylim(bottom=0)
    axes.set_xlim(left=0)
    axes.set_xlabel("memory budget (GiB)")
    axes.set_ylabel("largest model trained (M parameters)")
    device = report["device_name"]
    tokens = f"batch {report['batch_size']} x {report['seq_len']} tokens"
    extras = [f"{report['autocast']} autocast"] if report["autocast"] != "none" else []
    extras += ["activation checkpointing"] if report["checkpoint_activations"] else []
    title = f"gefen capacity: {device}\n{tokens}, {report['steps']} steps, fp32 weights"
    axes.set_title(", ".join([title, *extras]), fontsize=9)
    axes.margins(x=0.12)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``capacity`` on the top-level sub-parsers and return its parser (``args.func`` is :func:`run`)."""
    from gefen.cli._capacity_optimizers import CAPACITY_OPTIMIZERS

    parser = subparsers.add_parser(
        "capacity",
        help="find the largest model each optimizer trains within a memory budget",
        description=(
            "Train models of growing size (the demo's architecture, wider and deeper) for a few full steps, each "
            "in its own process under the memory budget, and report the largest that trained per optimizer. "
            f"Known optimizers: {', '.join(CAPACITY_OPTIMIZERS)} (the 8-bit ones where installed). Run time grows "
            "with the budget: an 8 GiB budget takes about 14 minutes on 2 CPU cores. Peaks vary by about 0.2 %% "
            "between identical runs, so a model right at the budget may fit in one run and not the next: the answer "
            "is good to one model of the family (2-5 %% in parameters above 100M). Memory is assumed to grow along "
            "the family, which holds while the weights dominate; with large batch x seq-len, where activations "
            "dominate, shapes of similar size differ and the boundary is approximate. Exit status 1 when a search "
            "was stopped by a run that failed for a reason other than memory (a timeout, an error)."
        ),
    )
    add = parser.add_argument
    add("--budget-gib", type=_positive_float, nargs="+", default=None, metavar="GIB",
        help="one or more budgets in GiB (default: 90%% of the memory available now on the CPU, the GPU's "
             "memory on CUDA)")  # fmt: skip
    add("--device", default=None, help="cpu or cuda[:N] (default: cuda when available, else cpu)")
    add("--optimizers", default=None, help="comma-separated names (default: adamw, gefen, gefen-muon-hybrid and the "
        "installed 8-bit AdamWs)")  # fmt: skip
    add("--batch-size", type=int, default=1, help="sequences per step (default: %(default)s)")
    add("--seq-len", type=int, default=None,
        help=f"bytes per sequence (default: {_CPU_SEQ} on CPU, {_CUDA_SEQ} on CUDA)")  # fmt: skip
    add("--steps", type=int, default=3, help="training steps each model must complete (default: %(default)s)")
    add("--threads", type=int, default=None, help="torch threads per run on the CPU (default: all usable cores)")
    add("--autocast", choices=("none", "bf16"), default=None,
        help="forward/backward under bf16 autocast, weights fp32 (default: bf16 on CUDA, none on CPU, where bf16 "
             "autocast is slower and keeps fp32 copies beside the bf16 ones)")  # fmt: skip
    add("--checkpoint-activations", action="store_true", help="recompute each block's activations in backward")
    add("--probe-timeout", type=_positive_float, default=1800.0,
        help="seconds before a run is stopped (default: %(default)s)")  # fmt: skip
    add("--seed", type=int, default=0, help="model and data seed (default: %(default)s)")
    add("--json", default=None, metavar="PATH", help="write the report as JSON here")
    add("--plot", default=None, metavar="PATH", help=f"write a PNG of parameters trained vs budget (needs {PIP_HINT})")
    parser.set_defaults(func=run)
    return parser


def _positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number > 0")
    return value


def _check_device(device: str) -> None:
    if device != "cpu" and not device.startswith("cuda"):
        raise _UsageError(f"--device {device!r}: use cpu or cuda[:N].")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise _UsageError(f"--device {device}: this torch sees no CUDA device.")
        index = device.partition(":")[2]
        if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
            raise _UsageError(f"--device {device}: this machine has CUDA devices 0..{torch.cuda.device_count() - 1}.")


def _resolve(args: argparse.Namespace) -> dict[str, Any]:
    from gefen.cli._capacity_optimizers import CAPACITY_OPTIMIZERS, available, default_names

    device = args.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    _check_device(device)
    names = default_names() if args.optimizers is None else [n.strip() for n in args.optimizers.split(",") if n.strip()]
    if not names:
        known = ", ".join(CAPACITY_OPTIMIZERS)
        raise _UsageError(f"--optimizers {args.optimizers!r} names no optimizer; known: {known}.")
    for name in names:
        if name not in CAPACITY_OPTIMIZERS:
            raise _UsageError(f"unknown optimizer {name!r}; known: {', '.join(CAPACITY_OPTIMIZERS)}.")
        if not available(name):
            raise _UsageError(f"{name} needs the {CAPACITY_OPTIMIZERS[name].requires!r} package, not installed here.")
    if len(set(names)) != len(names):
        raise _UsageError(f"--optimizers {args.optimizers!r}: give each name once.")
    for flag, value in (("--batch-size", args.batch_size), ("--steps", args.steps), ("--seq-len", args.seq_len),
                        ("--threads", args.threads)):  # fmt: skip
        if value is not None and value < 1:
            raise _UsageError(f"{flag}={value} must be >= 1.")
    if not 0 <= args.seed < 2**63:
        raise _UsageError(f"--seed={args.seed} must be in [0, 2**63).")
    if args.threads is not None and args.threads > default_threads():
        print(f"gefen capacity: warning: --threads {args.threads} is more than the {default_threads()} cores this "
              "process may use; the runs will be slower, not larger.", file=sys.stderr)  # fmt: skip
    try:
        budgets = [default_budget_bytes(device)] if args.budget_gib is None else [int(g * GIB) for g in args.budget_gib]
    except RuntimeError as error:
        raise _UsageError(str(error)) from None
    if any(b < 2**27 for b in budgets) or len(set(budgets)) != len(budgets):
        raise _UsageError(f"--budget-gib {args.budget_gib}: each budget at least 0.125 GiB, each once.")
    _warn_about_budgets(device, budgets)
    problem = output_problem("gefen capacity", {"--json": args.json, "--plot": args.plot}, args.plot, progress=True)
    if problem is not None:
        raise _UsageError(problem)
    return {
        "optimizers": names,
        "budgets_bytes": budgets,
        "device": device,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len or (_CUDA_SEQ if device.startswith("cuda") else _CPU_SEQ),
        "steps": args.steps,
        "threads": args.threads,
        "autocast": args.autocast or ("bf16" if device.startswith("cuda") else "none"),
        "checkpoint_activations": args.checkpoint_activations,
        "probe_timeout_s": args.probe_timeout,
        "seed": args.seed,
    }


def _warn_about_budgets(device: str, budgets: list[int]) -> None:
    def warn(text: str) -> None:
        print(f"gefen capacity: warning: {text}", file=sys.stderr)

    if device.startswith("cuda"):
        import torch

        total = torch.cuda.get_device_properties(torch.device(device)).total_memory
        if max(budgets) > total:
            warn(f"a budget of {max(budgets) / GIB:.2f} GiB is more than this GPU's {total / GIB:.2f} GiB; its runs "
                 "are capped at the GPU's memory.")  # fmt: skip
        return
    from gefen.cli._capacity_probe import read_peak_rss

    if read_peak_rss(os.getpid()) is None:
        warn("this system has no /proc/PID/status: runs cannot be stopped when they pass the budget, only judged by "
             "their peak afterwards (a run larger than the machine's memory may swap).")  # fmt: skip
    free = _available_cpu_bytes()
    if free is not None and max(budgets) > free:
        warn(f"a budget of {max(budgets) / GIB:.2f} GiB is more than the {free / GIB:.2f} GiB available now; the "
             "system may kill runs before they reach it (reported as killed).")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Execute ``gefen capacity``.

    Returns:
        0 when every search answered; 1 when a search was stopped by a run that failed for a reason other than
        memory (the report still prints and is written, those rows marked); 2 for a bad argument; 130 on Ctrl-C
        (or 143 on SIGTERM; the running child is killed either way). A run out of memory is an answer, not a
        failure.
    """
    try:
        settings = _resolve(args)
    except _UsageError as error:
        print(f"gefen capacity: error: {error}", file=sys.stderr)
        return 2
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _terminate)
    try:
        return _run(args, settings)
    except _Terminated:
        print("\ngefen capacity: terminated", file=sys.stderr)
        return 143
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Terminated(Exception):
    """SIGTERM arrived: unwind (the running child is killed on the way out) and exit 143."""


def _terminate(signum: int, frame: Any) -> None:
    raise _Terminated


def _run(args: argparse.Namespace, settings: dict[str, Any]) -> int:
    from tqdm import tqdm

    budgets = ", ".join(f"{b / GIB:g}" for b in sorted(settings["budgets_bytes"]))
    print(f"gefen capacity: {', '.join(settings['optimizers'])} on {settings['device']}, budget {budgets} GiB, "
          f"batch {settings['batch_size']} x {settings['seq_len']} bytes, {settings['steps']} steps per model",
          file=sys.stderr)  # fmt: skip
    bar = tqdm(unit="run", file=sys.stderr, dynamic_ncols=True, mininterval=0.5)

    def on_run(name: str, member: FamilyMember, budget: int, outcome: Outcome | None) -> None:
        if outcome is None:
            bar.set_description(f"{name} @ {budget / GIB:g} GiB: {member.label}")
            return
        peak = "" if outcome.peak_bytes is None else f" {outcome.peak_bytes / GIB:.2f} GiB"
        bar.set_postfix_str(f"last: {format_params(member.params)} {outcome.status.replace('_', ' ')}{peak}")
        bar.update(1)

    try:
        report = measure_capacity(**settings, on_run=on_run)
    except KeyboardInterrupt:
        bar.close()
        print("\ngefen capacity: interrupted", file=sys.stderr)
        return 130
    bar.close()
    print(format_table(report))
    print(f"({len(report['runs'])} training runs, {report['total_time_s']:.0f} s; peak = {report['memory']})")
    if args.json is not None:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.plot is not None:
        write_plot(args.plot, report)
        print(f"wrote {args.plot}")
    if not report["complete"]:
        print("gefen capacity: some searches were stopped by a run that failed for a reason other than memory (rows "
              "marked 'search stopped'); their sizes are lower bounds. See 'error' in the JSON.",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0
