r"""Muon hybrid ablation: walk from ``torch-muon-hybrid`` to ``gefen-muon-hybrid`` one change at a time, each
configuration at its own best lr, on the ``gefen demo`` task.

Configurations (:data:`CONFIGS`, in walk order; every one has the demo's shared policy: 2-D hidden weights on Muon
with momentum 0.95, Nesterov, weight decay 0.1 and ``adjust_lr_fn="match_rms_adamw"``; embeddings, head, norms on
the backup with betas (0.9, 0.95) and no decay; one lr for both halves):

* ``torch``: ``torch.optim.Muon`` (standard Newton–Schulz, 5 iterations; fp32 momentum) + ``torch.optim.AdamW``:
  the demo's ``torch-muon-hybrid``.
* ``+tuned3``: the same Muon with the ``tuned3`` schedule (:class:`ReferenceMuon`: fp32 momentum, gefen's
  Newton–Schulz and NorMuon functions) + AdamW.
* ``+normuon``: and NorMuon row normalisation.
* ``+8bit``: and Gefen's 8-bit codebook momentum: ``GefenMuonHybrid(backup_optimizer="adamw")``.
* ``+gefen-backup``: and the Gefen backup: ``GefenMuonHybrid`` as the demo's ``gefen-muon-hybrid`` builds it.
* ``+standard``: ``+gefen-backup`` with the ``standard`` schedule (5 iterations) instead of ``tuned3``:
  ``gefen-muon-hybrid`` with its defaults since this ablation.
* ``-normuon``: ``+standard`` without NorMuon.
* ``+original-lr``: ``+gefen-backup`` with ``adjust_lr_fn="original"`` (Muon's lr scaled by
  ``sqrt(max(1, R/C))`` instead of ``0.2·sqrt(max(R, C))``), to show what the shape rule buys.

On a CPU without bf16 matrix instructions torch's Newton–Schulz runs through gefen's (same iteration and grouping,
fp32 GEMMs of the bf16 operands: see ``gefen.cli._optimizers.torch_muon_gemms_in_fp32``), else a torch row takes
~50 minutes.

Every run trains the demo model (``gefen.cli.demo``'s loop: same data, schedule, clipping, eval) in a fresh
process; ``--workers`` runs go at once with ``--threads`` threads each. Results are merged into ``--json`` (runs
already there are not repeated), so a grid can grow in several invocations.

Output: a JSON file ``{"settings", "runs": [{"config", "lr", "seed", "eval_loss", "train_loss",
"state_bytes_per_param", "opt_step_time_s", "train_time_s"}], "best": {config: {"lr", "eval_loss": {seed: loss},
"mean_eval_loss", "seeds", "grid"}}}`` (losses in nats/byte, times in seconds; "best": :func:`best_lrs`),
a table on stdout and, with ``--plot``, a PNG of eval loss against lr per configuration.

Usage: ``python benchmarks/muon_ablation.py [--configs torch,+tuned3,...] [--lrs 3e-3,5e-3,8e-3] [--seeds 0,1]
[--steps 200] [--workers 2] [--threads 1] [--json docs/muon_ablation.json] [--plot docs/muon_ablation.png]``
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import math
import multiprocessing
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from gefen.cli.demo import _Job, _train_one
from gefen.math.newton_schulz import adjust_lr_ratio, newton_schulz, normuon_, resolve_schedule

__all__ = ["CONFIGS", "ReferenceMuon", "best_lrs", "build", "main"]

#: Walk order: each configuration changes one thing from the one before (``+original-lr``: from ``+gefen-backup``).
CONFIGS = ("torch", "+tuned3", "+normuon", "+8bit", "+gefen-backup", "+standard", "-normuon", "+original-lr")

_WEIGHT_DECAY = 0.1
_BETAS = (0.9, 0.95)


class ReferenceMuon(torch.optim.Optimizer):
    r"""Muon with an fp32 momentum buffer and gefen's Newton–Schulz (any schedule) and NorMuon: GefenMuon's update
    without the 8-bit quantization of the momentum (algorithm.md §7.1), for the ablation only.

    Per 2-D parameter ``W`` (R×C) with gradient ``G``: ``m ← lerp(m, G, 1−β)``; ``U = lerp(G, m, β)`` (Nesterov) or
    ``m``; ``O = NS(U)`` (bf16); NorMuon if enabled; ``W ← W·(1−ηλ) − η·r(R, C)·O``.

    Args:
        params: 2-D tensors.
        lr: η >= 0.
        weight_decay: λ >= 0, decoupled, with the raw lr.
        momentum: β in [0, 1).
        nesterov: Nesterov combination.
        ns_schedule: as :func:`gefen.math.newton_schulz.resolve_schedule` (5 standard iterations for ``None``).
        normuon: NorMuon row normalisation (β 0.95, ε 1e-8).
        adjust_lr_fn: ``"match_rms_adamw"`` or ``"original"``.
    """

    def __init__(
        self,
        params: Any,
        lr: float,
        weight_decay: float,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_schedule: str | None = None,
        normuon: bool = False,
        adjust_lr_fn: str = "match_rms_adamw",
    ) -> None:
        defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov}
        super().__init__(params, defaults)
        self.schedule = resolve_schedule(ns_schedule, 5)
        self.normuon = normuon
        self.adjust_lr_fn = adjust_lr_fn

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None if closure is None else closure()
        for group in self.param_groups:
            lr, beta = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad: Tensor = p.grad.float()
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(grad)
                    state["step"] = 0
                    if self.normuon:
                        state["normuon_v"] = torch.zeros(p.shape[0])
                buf = state["momentum_buffer"]
                buf.lerp_(grad, 1 - beta)
                state["step"] += 1
                update = grad.lerp(buf, beta) if group["nesterov"] else buf
                ortho = newton_schulz(update, self.schedule, 1e-7)
                if self.normuon:
                    normuon_(ortho, state["normuon_v"], state["step"], 0.95, 1e-8)
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(ortho.to(p.dtype), alpha=-lr * adjust_lr_ratio(self.adjust_lr_fn, *p.shape))
        return loss


def build(config: str, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """The optimizer of ablation configuration ``config`` over ``model`` at peak ``lr`` (see the module docstring).

    Raises:
        ValueError: an unknown configuration.
    """
    from gefen import GefenMuonHybrid, split_params_for_muon
    from gefen.cli._optimizers import OPTIMIZERS
    from gefen.cli._pair import OptimizerPair

    if config == "torch":
        return OPTIMIZERS["torch-muon-hybrid"].factory(model, lr)
    if config in ("+tuned3", "+normuon"):
        muon, backup = split_params_for_muon(model)
        first = ReferenceMuon(
            [p for _, p in muon], lr, _WEIGHT_DECAY, ns_schedule="tuned3", normuon=config == "+normuon"
        )
        second = torch.optim.AdamW([p for _, p in backup], lr=lr, betas=_BETAS, weight_decay=0.0)
        return OptimizerPair(first, second)
    if config in ("+8bit", "+gefen-backup", "+standard", "-normuon", "+original-lr"):
        return GefenMuonHybrid(
            model,
            lr=lr,
            betas=_BETAS,
            muon_weight_decay=_WEIGHT_DECAY,
            backup_weight_decay=0.0,
            backup_optimizer="adamw" if config == "+8bit" else "gefen",
            adjust_lr_fn="original" if config == "+original-lr" else "match_rms_adamw",
            ns_schedule="standard" if config in ("+standard", "-normuon") else "tuned3",
            normuon=config != "-normuon",
        )
    raise ValueError(f"unknown configuration {config!r}; known: {', '.join(CONFIGS)}")


def _run(job: _Job) -> dict[str, Any]:
    """One training run in this (spawned) process: the demo's loop with the ablation's optimizer."""
    from gefen.cli._optimizers import torch_muon_gemms_in_fp32

    torch_muon_gemms_in_fp32()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*adjust_lr_fn='original'.*")  # that row asks for it
        return _train_one(job)


def best_lrs(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per configuration, the lr with the lowest mean eval loss over the seeds it was run with.

    Only lrs run with the configuration's largest set of seeds compete (so a one-seed lucky point cannot beat a
    two-seed mean); diverged runs (NaN) lose.

    Args:
        runs: the ``runs`` entries of the JSON.

    Returns:
        ``{config: {"lr", "eval_loss": {seed: loss}, "mean_eval_loss", "seeds", "grid"}}``.
    """
    out: dict[str, dict[str, Any]] = {}
    for config in dict.fromkeys(run["config"] for run in runs):
        by_lr: dict[float, dict[int, float]] = {}
        for run in runs:
            if run["config"] == config:
                by_lr.setdefault(run["lr"], {})[run["seed"]] = run["eval_loss"]
        most = max(len(seeds) for seeds in by_lr.values())

        def score(lr: float, by_lr: dict[float, dict[int, float]] = by_lr) -> float:
            losses = list(by_lr[lr].values())
            mean = statistics.fmean(losses)
            return mean if math.isfinite(mean) else math.inf

        candidates = [lr for lr, seeds in by_lr.items() if len(seeds) == most]
        best = min(candidates, key=score)
        out[config] = {
            "lr": best,
            "eval_loss": {str(seed): loss for seed, loss in sorted(by_lr[best].items())},
            "mean_eval_loss": score(best),
            "seeds": sorted(by_lr[best]),
            "grid": sorted(by_lr),
        }
    return out


def _table(runs: Sequence[dict[str, Any]], best: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| configuration | best lr | eval loss (seeds) | mean | vs torch | state B/param | lrs tried |",
        "|---|---:|---|---:|---:|---:|---|",
    ]
    reference = best.get("torch", {}).get("mean_eval_loss")
    for config in [c for c in CONFIGS if c in best] + [c for c in best if c not in CONFIGS]:
        entry = best[config]
        state = next(r["state_bytes_per_param"] for r in runs if r["config"] == config and r["lr"] == entry["lr"])
        losses = ", ".join(f"{loss:.4f}" for loss in entry["eval_loss"].values())
        ratio = f"{entry['mean_eval_loss'] / reference:.4f}x" if reference else "—"
        grid = ", ".join(f"{lr:g}" for lr in entry["grid"])
        mean = entry["mean_eval_loss"]
        lines.append(f"| `{config}` | {entry['lr']:g} | {losses} | {mean:.4f} | {ratio} | {state:.3f} | {grid} |")
    return "\n".join(lines)


def _plot(path: str, runs: Sequence[dict[str, Any]], best: dict[str, dict[str, Any]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(9, 5.5), constrained_layout=True)
    first_seed = min(run["seed"] for run in runs)
    for index, config in enumerate(best):
        points = sorted(
            (run["lr"], run["eval_loss"])
            for run in runs
            if run["config"] == config and run["seed"] == first_seed and math.isfinite(run["eval_loss"])
        )
        if points:
            lrs, losses = zip(*points, strict=True)
            axes.plot(lrs, losses, "o-", color=f"C{index}", label=f"{config} (seed {first_seed})")
        others = [(r["lr"], r["eval_loss"]) for r in runs if r["config"] == config and r["seed"] != first_seed]
        if others:
            axes.scatter(*zip(*others, strict=True), color=f"C{index}", s=18, marker="x")
        entry = best[config]
        axes.scatter([entry["lr"]], [entry["mean_eval_loss"]], color=f"C{index}", s=110, marker="*", zorder=3)
    axes.set_xscale("log")
    axes.set_xlabel("peak lr (both halves)")
    axes.set_ylabel("eval loss after the last step, nats/byte")
    axes.grid(alpha=0.3)
    axes.legend()
    axes.set_title(title, fontsize=9)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ablation grid; return 0, or 1 when a run failed (its error on stderr)."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--configs", default=",".join(CONFIGS[:7]), help="comma-separated configurations")
    parser.add_argument("--lrs", default="3e-3,5e-3,8e-3", help="comma-separated peak lrs")
    parser.add_argument("--seeds", default="0,1", help="comma-separated seeds")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2, help="runs at once (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (default: %(default)s)")
    parser.add_argument("--json", default="muon_ablation.json", help="results file, merged into if it exists")
    parser.add_argument("--plot", default=None, help="PNG of eval loss against lr")
    args = parser.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; known: {', '.join(CONFIGS)}")
    lrs, seeds = _floats(args.lrs), [int(s) for s in args.seeds.split(",") if s.strip()]
    from gefen.cli._data import load_corpus

    corpus = load_corpus(None)
    train_bytes, eval_bytes = corpus.train.numpy().tobytes(), corpus.eval.numpy().tobytes()
    path = Path(args.json)
    report: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {"runs": []}
    settings = {"steps": args.steps, "threads": args.threads, "model_size": "small", "batch_size": 16, "seq_len": 128}
    if report.get("settings", settings) != settings:
        parser.error(f"{path} holds runs with other settings {report['settings']}; use another --json")
    report["settings"] = settings
    done = {(r["config"], r["lr"], r["seed"]) for r in report["runs"]}
    todo = [(c, lr, s) for s in seeds for c in configs for lr in lrs if (c, lr, s) not in done]
    print(f"muon_ablation: {len(todo)} runs to do ({len(done)} already in {path})", file=sys.stderr, flush=True)
    failed = 0
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=args.workers, mp_context=context) as pool:
        futures = {}
        for config, lr, seed in todo:
            job = _Job(
                name=config,
                lr=lr,
                model_size="small",
                seq_len=128,
                batch_size=16,
                steps=args.steps,
                seed=seed,
                threads=args.threads,
                eval_every=args.steps,
                train_bytes=train_bytes,
                eval_bytes=eval_bytes,
                factory=functools.partial(build, config),
            )
            futures[pool.submit(_run, job)] = (config, lr, seed)
        started = time.perf_counter()
        for future in concurrent.futures.as_completed(futures):
            config, lr, seed = futures[future]
            try:
                result = future.result()
            except Exception as error:  # noqa: BLE001 - reported, the grid goes on
                failed += 1
                print(f"muon_ablation: {config} lr {lr:g} seed {seed} failed: {error!r}", file=sys.stderr)
                continue
            report["runs"].append(
                {
                    "config": config,
                    "lr": lr,
                    "seed": seed,
                    "eval_loss": result["eval_loss"],
                    "train_loss": result["train_loss"],
                    "state_bytes_per_param": result["state_bytes_per_param"],
                    "opt_step_time_s": result["opt_step_time_s"],
                    "train_time_s": result["_train_time_s"],
                }
            )
            report["best"] = best_lrs(report["runs"])
            path.write_text(json.dumps(report, indent=1) + "\n")
            print(
                f"muon_ablation: {config:>14} lr {lr:<6g} seed {seed}: eval {result['eval_loss']:.4f} "
                f"({time.perf_counter() - started:.0f} s elapsed)",
                file=sys.stderr,
                flush=True,
            )
    report["best"] = best_lrs(report["runs"])
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(_table(report["runs"], report["best"]))
    if args.plot:
        title = (
            f"Muon hybrid ablation, gefen demo task ({args.steps} steps): lines seed 0, x other seeds, "
            "star = mean over seeds at the best lr"
        )
        _plot(args.plot, report["runs"], report["best"], title)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
