r"""Cost of ``nonfinite="skip"``'s NaN/Inf check in ``gefen demo``'s training step (issue 14: <= 1 %).

Builds the demo's model (``--model-size``, batch 16 x 128 bytes by default), then steps two Gefen optimizers over it
alternately, one with the default ``nonfinite="skip"`` and one with ``"propagate"`` (no check), each step a full
forward/backward/step, and times the check alone on the same gradients. Prints one JSON object::

    {"params": int, "train_step_s": {"skip": float, "propagate": float}, "check_s": float,
     "check_share_of_train_step": float, "ratio_skip_vs_propagate": float}

Times are medians in seconds over ``--steps`` interleaved pairs; ``check_share_of_train_step`` is the check's
median over the ``skip`` step's median (the number the issue bounds; the pair ratio is noisier than the check
itself on a shared machine). ``check_s`` times the check as a separate read of the gradients (what a first step,
the eager backend or the hybrid pays); a steady native CPU step makes it inside the library's own passes, so there
``ratio_skip_vs_propagate`` is its whole cost. No assertion is made here.

Usage: ``python benchmarks/nonfinite_cost.py [--steps 30] [--model-size small]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import gefen
from gefen.amp import unusable_names
from gefen.cli._model import build_model


def main() -> None:
    """Parse arguments, time both policies and the check, print the JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--model-size", choices=["tiny", "small"], default="small")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = build_model(args.model_size, args.seq_len, 0)
    tokens = torch.randint(0, 256, (args.batch_size, args.seq_len + 1))
    named = list(model.named_parameters())
    optimizers = {policy: gefen.Gefen(named, lr=1e-3, nonfinite=policy) for policy in ("skip", "propagate")}

    def train_step(opt: torch.optim.Optimizer) -> None:
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for opt in optimizers.values():
        for _ in range(3):
            train_step(opt)
    times: dict[str, list[float]] = {policy: [] for policy in optimizers}
    checks = []
    for _ in range(args.steps):
        for policy, opt in optimizers.items():
            start = time.perf_counter()
            train_step(opt)
            times[policy].append(time.perf_counter() - start)
        model(tokens[:, :-1]).sum().backward()
        grads = [(name, p.grad) for name, p in named]
        start = time.perf_counter()
        unusable_names(grads)
        checks.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    step = {policy: statistics.median(values) for policy, values in times.items()}
    check = statistics.median(checks)
    pairs = [a / b for a, b in zip(times["skip"], times["propagate"])]
    print(
        json.dumps(
            {
                "params": sum(p.numel() for p in model.parameters()),
                "train_step_s": step,
                "check_s": check,
                "check_share_of_train_step": check / step["skip"],
                "ratio_skip_vs_propagate": statistics.median(pairs),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
