"""Median ``optimizer.step()`` time and state bytes/param of Gefen and torch's AdamW (fused and foreach) on a
GPT-shaped parameter set (embedding, q/k/v/o, SwiGLU gate/up/down, RMSNorm), all in one process.

Prints one JSON object::

    {"params": int, "device": str, "threads": int,
     "results": {NAME: {"opt_step_time_s": float, "state_bytes_per_param": float}},
     "ratio_gefen_vs_adamw_fused": float}

Times are medians over ``--steps`` timed steps after ``--warmup`` untimed ones (the first Gefen step, which runs
the period search and learns the codebook, is never timed). Gradients are fixed random tensors, regenerated
by nobody: the step only reads them. No assertion on speed is made here; the issues set the bounds.

Usage: ``python benchmarks/step.py [--size 25m] [--steps 20] [--device cpu]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

import gefen

#: (d_model, n_layers, ffn hidden, vocab) per named size; ~25M and ~125M parameters.
SIZES = {"25m": (512, 6, 1408, 8192), "125m": (768, 12, 2048, 32768), "tiny": (128, 2, 352, 1024)}


def gpt_shaped_params(size: str, device: torch.device, seed: int = 0) -> list[tuple[str, torch.nn.Parameter]]:
    """Named fp32 parameters of a GPT-shaped decoder with random fp32 gradients attached.

    Args:
        size: a key of :data:`SIZES`.
        device: where the tensors live.
        seed: RNG seed of values and gradients.

    Returns:
        ``[(name, parameter)]`` with ``.grad`` set; embedding (vocab, d), per layer q/k/v/o (d, d), SwiGLU
        gate/up (ff, d) and down (d, ff), two RMSNorm weights (d,), and a final norm (d,).
    """
    d, layers, ff, vocab = SIZES[size]
    gen = torch.Generator().manual_seed(seed)
    shapes = [("embed.weight", (vocab, d))]
    for i in range(layers):
        shapes += [(f"layers.{i}.attn.{n}.weight", (d, d)) for n in ("q", "k", "v", "o")]
        shapes += [(f"layers.{i}.mlp.gate.weight", (ff, d)), (f"layers.{i}.mlp.up.weight", (ff, d))]
        shapes += [(f"layers.{i}.mlp.down.weight", (d, ff))]
        shapes += [(f"layers.{i}.norm1.weight", (d,)), (f"layers.{i}.norm2.weight", (d,))]
    shapes.append(("norm.weight", (d,)))
    params = []
    for name, shape in shapes:
        p = torch.nn.Parameter((torch.randn(shape, generator=gen) * 0.02).to(device))
        row_scale = torch.exp(torch.randn(shape[0], *([1] * (len(shape) - 1)), generator=gen))
        p.grad = (torch.randn(shape, generator=gen) * 1e-3 * row_scale).to(device)
        params.append((name, p))
    return params


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    if isinstance(opt, gefen.Gefen):
        return opt.state_bytes()
    return sum(
        t.numel() * t.element_size()
        for st in opt.state.values()
        for t in st.values()
        if isinstance(t, torch.Tensor)
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(opt: torch.optim.Optimizer, device: torch.device, steps: int, warmup: int) -> float:
    """Median wall time of ``opt.step()`` in seconds over ``steps`` calls after ``warmup`` untimed calls."""
    for _ in range(warmup):
        opt.step()
    _sync(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    """Parse arguments, run every optimizer on the same parameter set, print the JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="25m")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per optimizer")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (includes Gefen's first)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)

    named = gpt_shaped_params(args.size, device)
    params = [p for _, p in named]
    n_params = sum(p.numel() for p in params)
    factories: dict[str, Callable[[], torch.optim.Optimizer]] = {
        "adamw_fused": lambda: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, fused=True),
        "adamw_foreach": lambda: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, foreach=True),
        "gefen": lambda: gefen.Gefen(named, lr=1e-3, weight_decay=0.1),
    }
    initial = [p.detach().clone() for p in params]
    results = {}
    for name, make in factories.items():
        with torch.no_grad():
            for p, v in zip(params, initial):
                p.copy_(v)
        opt = make()
        step_s = time_steps(opt, device, args.steps, args.warmup)
        results[name] = {"opt_step_time_s": step_s, "state_bytes_per_param": _state_bytes(opt) / n_params}
        del opt
    print(
        json.dumps(
            {
                "params": n_params,
                "device": str(device),
                "threads": torch.get_num_threads(),
                "results": results,
                "ratio_gefen_vs_adamw_fused": results["gefen"]["opt_step_time_s"]
                / results["adamw_fused"]["opt_step_time_s"],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
