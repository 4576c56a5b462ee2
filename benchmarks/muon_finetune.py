r"""Why Muon on MiniLM's pooler costs ~50 points in the Trainer gate, and which fine-tuning recipe works.

One fine-tuning run of all-MiniLM-L6-v2 on the gate's task (``benchmarks/trainer_resume.py``: six-class stdlib
docstrings, batch 16, 48 tokens, 60 steps, linear warm-up over 6 steps then linear decay, grad-norm clipping at
1.0, weight decay on 2-D weights) in a plain training loop (no Trainer, no checkpoint: the gate's resume machinery
is not what is measured here), with one of:

* ``adamw``: ``torch.optim.AdamW(fused=True)``, decay ``--wd`` on weights, none on biases and LayerNorm;
* ``hybrid-adamw`` / ``hybrid-gefen``: ``gefen.GefenMuonHybrid`` with that backup (its defaults otherwise), Muon
  weight decay ``--wd``, backup decay 0, ``deterministic=True``;
* ``torch-muon``: ``torch.optim.Muon`` (``adjust_lr_fn``, decay ``--wd``) on the same matrices + ``torch.optim.AdamW``
  on the rest, to tell Muon's behaviour from gefen's.

``--layers 0`` trains the pooler and classifier only, ``--layers all`` everything. ``--backup-pooler`` is the
fine-tuning recipe: the freshly initialised pooler goes to the backup
(``backup_substrings=(*gefen.DEFAULT_BACKUP_SUBSTRINGS, "pooler")``). ``--backup-factored``
gives a Gefen backup's 2-D weights the factored second moment (``backup_factored_v_2d=True``; the hybrid's default is
the block one). ``--muon-lr`` gives Muon its own lr (the
backup keeps ``--lr``). ``--diag`` prints, for the first 8 steps, the pooler update's RMS over the lr and the stable
rank ``‖G‖_F² / ‖G‖_2²`` of its gradient.

Prints one JSON line: ``{"opt", "layers", "lr", "muon_lr", "wd", "adjust", "backup_pooler", "backup_factored", "seed",
"eval_accuracy" (fraction of the 276 eval docstrings), "final_loss", "wall_s", "opt_step_s" (median seconds of
``optimizer.step()``), "pooler_relative_change" (‖W − W₀‖_F / ‖W₀‖_F), "pooler_initial_std"}``.

Usage: ``python benchmarks/muon_finetune.py --opt hybrid-adamw [--layers 0|all] [--backup-pooler] [--lr 1e-4]
[--muon-lr X] [--wd 0.01] [--adjust match_rms_adamw|original] [--seed 0] [--steps 60] [--threads N] [--diag]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trainer_resume as gate  # noqa: E402
from stdlib_docstrings import build_dataset  # noqa: E402

__all__ = ["OPTIMIZERS", "main"]

#: ``--opt`` choices.
OPTIMIZERS = ("adamw", "hybrid-adamw", "hybrid-gefen", "torch-muon")


def _decay_groups(named: Sequence[tuple[str, torch.nn.Parameter]], wd: float) -> list[dict[str, Any]]:
    no_decay = [p for n, p in named if n.endswith("bias") or "LayerNorm" in n]
    ids = {id(p) for p in no_decay}
    decay = [p for _, p in named if id(p) not in ids]
    groups = ({"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0})
    return [g for g in groups if g["params"]]


def _optimizer(opts: argparse.Namespace, model: torch.nn.Module) -> torch.optim.Optimizer:
    import gefen
    from gefen.cli._optimizers import torch_muon_gemms_in_fp32
    from gefen.cli._pair import OptimizerPair

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    substrings = (*gefen.DEFAULT_BACKUP_SUBSTRINGS, *(("pooler",) if opts.backup_pooler else ()))
    muon_lr = opts.muon_lr or opts.lr
    if opts.opt == "adamw":
        return torch.optim.AdamW(_decay_groups(named, opts.wd), lr=opts.lr, fused=True)
    if opts.opt == "torch-muon":
        torch_muon_gemms_in_fp32()
        muon, backup = gefen.split_params_for_muon(model, substrings)
        first = torch.optim.Muon([p for _, p in muon], lr=muon_lr, weight_decay=opts.wd, adjust_lr_fn=opts.adjust)
        return OptimizerPair(first, torch.optim.AdamW(_decay_groups(backup, opts.wd), lr=opts.lr))
    return gefen.GefenMuonHybrid(
        model,
        lr=muon_lr,
        backup_lr=opts.lr,
        backup_optimizer=opts.opt.split("-")[1],
        weight_decay=opts.wd,
        backup_weight_decay=0.0,
        adjust_lr_fn=opts.adjust,
        backup_substrings=substrings,
        backup_factored_v_2d=opts.backup_factored,
        deterministic=True,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run one fine-tune (see the module docstring) and print its JSON line; return 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--opt", choices=OPTIMIZERS, required=True)
    parser.add_argument("--layers", default="0", help="'all' or 0..6 top encoder layers trained with the head")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--muon-lr", type=float, default=None)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--wd", type=float, default=0.01)
    parser.add_argument("--adjust", default="match_rms_adamw", choices=("match_rms_adamw", "original"))
    parser.add_argument("--backup-pooler", action="store_true")
    parser.add_argument("--backup-factored", action="store_true", help="a Gefen backup keeps the factored moment")
    parser.add_argument("--diag", action="store_true")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    opts = parser.parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(opts.threads)
    dataset = build_dataset(seed=opts.seed)
    model = gate.load_model(len(dataset.labels), opts.seed, None if opts.layers == "all" else int(opts.layers))
    train, eval_set = gate._tokenize(dataset, "train", 48), gate._tokenize(dataset, "eval", 48)
    collate = gate._collator()
    optimizer = _optimizer(opts, model)
    warmup = opts.steps // 10

    def multiplier(step: int) -> float:
        return (step + 1) / warmup if step < warmup else max(0.0, (opts.steps - step) / (opts.steps - warmup))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
    generator = torch.Generator().manual_seed(opts.seed)
    order: list[int] = []
    trainable = [p for p in model.parameters() if p.requires_grad]
    pooler = model.bert.pooler.dense.weight
    initial = pooler.detach().clone()
    step_times = []
    start = time.perf_counter()
    for step in range(opts.steps):
        if len(order) < 16:
            order = torch.randperm(len(train), generator=generator).tolist()
        batch = collate([train[i] for i in order[:16]])
        order = order[16:]
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        before = pooler.detach().clone()
        tick = time.perf_counter()
        optimizer.step()
        step_times.append(time.perf_counter() - tick)
        if opts.diag and step < 8 and pooler.grad is not None:
            lr = scheduler.get_last_lr()[0]
            rms = (pooler.detach() - before).pow(2).mean().sqrt().item() / lr
            grad = pooler.grad
            stable_rank = (grad.norm() ** 2 / torch.linalg.matrix_norm(grad, 2) ** 2).item()
            print(f"step {step + 1}: pooler update RMS / lr {rms:.3f}, gradient stable rank {stable_rank:.1f}")
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    result = {
        "opt": opts.opt,
        "layers": opts.layers,
        "lr": opts.lr,
        "muon_lr": opts.muon_lr or opts.lr,
        "wd": opts.wd,
        "adjust": opts.adjust,
        "backup_pooler": opts.backup_pooler,
        "backup_factored": opts.backup_factored,
        "seed": opts.seed,
        "eval_accuracy": gate.eval_accuracy(model, eval_set),
        "final_loss": loss.item(),
        "wall_s": round(time.perf_counter() - start, 1),
        "opt_step_s": statistics.median(step_times),
        "pooler_relative_change": ((pooler.detach() - initial).norm() / initial.norm()).item(),
        "pooler_initial_std": initial.std().item(),
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
