r"""Where Muon's Newton–Schulz time goes on this machine: GEMM throughput of each path against the matrix shapes
of a real step.

For each parameter set (``demo``: the ``gefen demo`` model's 28 hidden matrices; ``minilm``: all-MiniLM-L6-v2's 37
hidden matrices, pooler included; ``25m``: ``benchmarks/step.py``'s GPT-shaped set) and each distinct shape, it
times :func:`gefen.math.newton_schulz.newton_schulz` (``standard``, the hybrid's default: 5 iterations of 3 GEMMs)
with bf16 GEMMs (torch's bf16 ``addmm``) and with fp32 GEMMs of the bf16 operands (the path gefen takes on a CPU
without bf16 matrix instructions, :func:`~gefen.math.newton_schulz.bf16_gemm_is_native` False), and reports the
GEMM work (FLOP, 2 per multiply-add) over the time. The machine's own scale is the fp32 throughput of one large
square GEMM (``--peak-size``) in the same process.

Prints one JSON object::

    {"device", "threads", "bf16_gemm_is_native": bool, "fp32_gemm_gflop_s": float, "bf16_gemm_gflop_s": float,
     "sets": {SET: {"matrices": int, "gflop_per_step": float,
                    "shapes": [{"shape": [R, C], "count": int, "gflop": float,
                                "bf16_s": float, "fp32_s": float}],
                    "bf16_s_per_step": float, "fp32_s_per_step": float, "gefen_s_per_step": float,
                    "speedup_fp32_over_bf16": float}}}

(seconds are medians of ``--repeats`` calls per shape, times the shape's count; ``gefen_s_per_step`` is the path
:func:`newton_schulz` takes here). Progress on stderr.

Usage: ``python benchmarks/newton_schulz.py [--sets demo,minilm(,25m)] [--repeats 3] [--peak-size 1024]``
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch

from gefen.math import newton_schulz as ns

__all__ = ["SETS", "gemm_flop", "main"]


def _demo_shapes() -> list[tuple[int, int]]:
    from gefen import split_params_for_muon
    from gefen.cli._model import build_model

    muon, _ = split_params_for_muon(build_model("small", 128, 0))
    return [tuple(p.shape) for _, p in muon]  # type: ignore[misc]


def _minilm_shapes() -> list[tuple[int, int]]:
    # 6 layers x (q, k, v, attention output 384x384; intermediate 1536x384; output 384x1536) + pooler 384x384
    return [(384, 384)] * 4 * 6 + [(1536, 384), (384, 1536)] * 6 + [(384, 384)]


def _gpt_shapes() -> list[tuple[int, int]]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from step import SIZES

    d, layers, ff, _ = SIZES["25m"]  # step.py's hidden matrices: q, k, v, o (d, d); gate, up (ff, d); down (d, ff)
    return ([(d, d)] * 4 + [(ff, d)] * 2 + [(d, ff)]) * layers


#: Parameter sets: name -> function returning the hidden-matrix shapes of one step.
SETS: dict[str, Callable[[], list[tuple[int, int]]]] = {
    "demo": _demo_shapes,
    "minilm": _minilm_shapes,
    "25m": _gpt_shapes,
}


def gemm_flop(shape: tuple[int, int], iterations: int) -> float:
    """GEMM FLOP of ``iterations`` Newton–Schulz iterations on a ``(R, C)`` matrix (wide orientation ``m <= n``):
    ``A = X·Xᵀ`` (2m²n), ``A·A`` (2m³), ``M·X`` (2m²n) each iteration."""
    m, n = sorted(shape)
    return iterations * (4.0 * m * m * n + 2.0 * m**3)


def _median_time(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _gemm_gflop_s(size: int, dtype: torch.dtype, repeats: int) -> float:
    a = torch.randn(size, size).to(dtype)
    return 2.0 * size**3 / _median_time(lambda: a @ a, repeats) / 1e9


def main() -> None:
    """Parse arguments, time every set, print the JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sets", default="demo,minilm", help=f"comma-separated among {', '.join(SETS)}")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per shape and path (median)")
    parser.add_argument("--peak-size", type=int, default=1024, help="side of the square GEMM of the scale rows")
    args = parser.parse_args()
    schedule = ns.resolve_schedule("standard", 5)
    native = ns.bf16_gemm_is_native(torch.device("cpu"))
    report: dict[str, object] = {
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "bf16_gemm_is_native": native,
        "fp32_gemm_gflop_s": _gemm_gflop_s(args.peak_size, torch.float32, args.repeats),
        "bf16_gemm_gflop_s": _gemm_gflop_s(args.peak_size, torch.bfloat16, 1),
    }
    sets = {}
    for name in [s.strip() for s in args.sets.split(",") if s.strip()]:
        counts = collections.Counter(SETS[name]())
        rows = []
        for shape, count in counts.items():
            print(f"[newton_schulz.py] {name} {shape} x{count}", file=sys.stderr, flush=True)
            update = torch.randn(shape, generator=torch.Generator().manual_seed(0))
            row: dict[str, object] = {"shape": list(shape), "count": count}
            row["gflop"] = gemm_flop(shape, len(schedule)) * count / 1e9
            for label, flag in (("bf16_s", True), ("fp32_s", False)):
                with mock.patch.object(ns, "bf16_gemm_is_native", lambda device, flag=flag: flag):
                    seconds = _median_time(lambda u=update: ns.newton_schulz(u, schedule, 1e-7), args.repeats)
                row[label] = seconds * count
            rows.append(row)
        bf16_s = sum(float(r["bf16_s"]) for r in rows)  # type: ignore[arg-type]
        fp32_s = sum(float(r["fp32_s"]) for r in rows)  # type: ignore[arg-type]
        sets[name] = {
            "matrices": sum(counts.values()),
            "gflop_per_step": sum(float(r["gflop"]) for r in rows),  # type: ignore[arg-type]
            "shapes": rows,
            "bf16_s_per_step": bf16_s,
            "fp32_s_per_step": fp32_s,
            "gefen_s_per_step": bf16_s if native else fp32_s,
            "speedup_fp32_over_bf16": bf16_s / fp32_s,
        }
    report["sets"] = sets
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
