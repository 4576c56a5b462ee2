r"""Median ``optimizer.step()`` time and state bytes/param of Gefen and torch's AdamW (fused and foreach) on a
GPT-shaped parameter set (embedding, q/k/v/o, SwiGLU gate/up/down, RMSNorm), all in one process.

Prints one JSON object::

    {"params": int, "device": str, "threads": int, "stream_bandwidth_gb_s": float,
     "results": {NAME: {"opt_step_time_s": float, "first_step_time_s": float, "compile_time_s": float,
                        "triton_jit_time_s": float, "peak_extra_memory_bytes": int | null,
                        "state_bytes_per_param": float, "bytes_moved_per_param": float, "effective_gb_s": float,
                        "compiled_signatures": int (Gefen only)}},
     "ratio_gefen_vs_adamw_fused": float, "interleaved": {...}, "ratio_gefen_vs_adamw_fused_sequential_rows": float,
     "ratio_gefen_native_vs_adamw_fused": float,
     "ratio_gefen_compiled_vs_adamw_fused": float, "ratio_gefen_eager_vs_adamw_fused": float,
     "ratio_gefen_first_step_vs_step": float, "first_step_pairs": {...}, "ratio_gefen_muon_vs_torch_muon": float,
     "ratio_gefen_vs_adamw_fused_1_thread": float, "torch_muon_newton_schulz_in_fp32": bool, "nonfinite_check_s": float,
     "nonfinite_check_fraction_of_gefen_step": float, "nonfinite_check_eager_s": float}

``NAME`` is ``adamw_fused``, ``adamw_foreach``, ``gefen`` (the default ``backend="auto"``: the native kernels on
the CPU), ``gefen_native``, ``gefen_compiled`` (``torch.compile``\ d kernels), ``gefen_eager``, ``gefen_triton``
(CUDA: the hand-written Triton kernels), the same ``adamw_fused`` and ``gefen`` rows again with one thread
(``*_1_thread``), and on the 2-D hidden weights only (the Muon half of a hybrid; their rows carry ``params`` and
bytes/param over those) ``torch_muon`` and ``gefen_muon``.
On a CPU without bf16 matrix instructions (no AVX-512 BF16 or AMX) ``torch_muon``'s Newton–Schulz runs as fp32
GEMMs of the bf16 operands, as in ``gefen demo`` (``gefen.cli._optimizers.torch_muon_gemms_in_fp32``: the same
values up to fp32 summation order; on a Zen 1 machine torch's own scalar bf16 fallback took 2.0 s per 512 x 512
matrix per step against 0.19 s, which made this row last tens of minutes); ``torch_muon_newton_schulz_in_fp32``
says whether it did.
``bytes_moved_per_param`` counts the memory one step reads and writes per parameter (parameter and gradient,
AdamW's two moments, Gefen's codes, magnitudes and second moment, and the factored second pass over the gradient),
``effective_gb_s`` is that traffic over the step time, to compare with ``stream_bandwidth_gb_s`` (a large
``copy_`` with the same threads: the machine's streaming bandwidth). ``--skip-compiled`` leaves out the compiled
row (its first run compiles for tens of seconds), ``--skip-muon`` the two Muon rows. Progress goes to
stderr.

The two headline ratios ``ratio_gefen_vs_adamw_fused`` (and its ``_1_thread`` twin) come from stepping fused AdamW
and the default Gefen alternately on the same parameters (``interleaved``: median times and the median of the
per-pair ratios), because on a shared machine the clock drifts between rows measured one after the other; the
``ratio_*`` of the other rows divide their sequential medians.
``opt_step_time_s`` is the median over
``--steps`` timed steps after ``--warmup`` untimed ones, the first of which is timed separately as
``first_step_time_s`` (Gefen: period search, codebook, compilation excluded) with the compile time reported as
``compile_time_s`` (torch.compile, seconds; smaller with a warm inductor cache, 0 for torch's optimizers and on the
Triton backend) and ``triton_jit_time_s`` (Triton's compiler for the Triton backend's kernels; 0 with warm caches).
``ratio_gefen_first_step_vs_step`` comes from ``--first-repeats`` (5) fresh default Gefen optimizers
(``first_step_pairs``: each one's first step over the median of its next ``--steps // 2`` regular steps, then the
medians of the first steps, the regular steps and the ratios), not from the ``gefen`` row's single first step.
``nonfinite_check_s`` is what the NaN/Inf check of a default (``nonfinite="skip"``) Gefen step costs (seconds):
the median step time of the default Gefen minus that of ``nonfinite="propagate"``, stepped alternately (on the
CPU the native step checks inside its own passes, so this is within noise of 0 and may come out negative);
``nonfinite_check_fraction_of_gefen_step`` its share of the default Gefen step; ``nonfinite_check_eager_s`` the
median time of the check as a separate read of every gradient (``gefen.amp.unusable_names``: one min/max reduction
per gradient and one host read), which the other paths (CUDA, eager, the hybrid's preflight) make.
``peak_extra_memory_bytes`` is the peak memory above the level before the timed steps (CPU: Linux resident-set
high-water mark; CUDA: allocator peak). Gradients are fixed random tensors: the step only reads them. No
assertion on speed is made here; the issues set the bounds.

Usage: ``python benchmarks/step.py [--size 25m] [--steps 20] [--device cpu]``
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

import gefen
from gefen.amp import unusable_names

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
        t.numel() * t.element_size() for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _read_status_kib(field: str) -> int | None:
    """A ``VmRSS``/``VmHWM`` line of ``/proc/self/status`` in KiB (``None`` where there is no procfs)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakMemory:
    """Peak memory above the level at :meth:`start`, in bytes, while the steps run.

    CUDA: the caching allocator's peak. CPU (Linux): the resident-set high-water mark, reset through
    ``/proc/self/clear_refs`` (large transient buffers are mmap-ed and returned on free, so they show up);
    ``None`` elsewhere.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.base: int | None = None

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as refs:
                refs.write("5")  # resets VmHWM to the current RSS
        except OSError:
            self.base = None
            return
        rss = _read_status_kib("VmRSS")
        self.base = None if rss is None else rss * 1024

    def extra_bytes(self) -> int | None:
        if self.base is None:
            return None
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.base
        hwm = _read_status_kib("VmHWM")
        return None if hwm is None else max(0, hwm * 1024 - self.base)


def stream_bandwidth(device: torch.device, nbytes: int = 1 << 28) -> float:
    """Streaming memory bandwidth in GB/s: bytes read plus written by a large ``copy_`` (best of 5)."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best / 1e9


def bytes_moved(opt: torch.optim.Optimizer) -> float:
    """Bytes one step reads and writes, summed over the parameters (see the module docstring)."""
    total = 0.0
    for group in opt.param_groups:
        for p in group["params"]:
            n, es = p.numel(), p.element_size()
            grad = p.grad.element_size() if p.grad is not None else es
            if isinstance(opt, gefen.Gefen):
                st = opt.state.get(p, {})
                state = sum(t.numel() * t.element_size() for t in st.values() if isinstance(t, torch.Tensor))
                second_pass = grad * n if "second_moment_row" in st else 0.0
                total += 2 * es * n + grad * n + second_pass + 2 * state
            else:
                state = sum(
                    t.numel() * t.element_size()
                    for t in opt.state.get(p, {}).values()
                    if isinstance(t, torch.Tensor) and t.numel() > 1
                )
                total += 2 * es * n + grad * n + 2 * state
    return total


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


def interleaved(
    make_a: Callable[[], torch.optim.Optimizer],
    make_b: Callable[[], torch.optim.Optimizer],
    device: torch.device,
    steps: int,
    warmup: int,
) -> dict[str, float]:
    """Step two optimizers of the same parameters alternately and return their median step times (seconds) and
    the median of the per-pair ratios b/a: drifts of the machine (clock, a busy neighbour) hit both alike."""
    a, b = make_a(), make_b()
    for _ in range(max(1, warmup)):
        a.step()
        b.step()
    times_a, times_b, ratios = [], [], []
    for _ in range(steps):
        pair = []
        for opt in (a, b):
            _sync(device)
            start = time.perf_counter()
            opt.step()
            _sync(device)
            pair.append(time.perf_counter() - start)
        times_a.append(pair[0])
        times_b.append(pair[1])
        ratios.append(pair[1] / pair[0])
    return {"a_s": statistics.median(times_a), "b_s": statistics.median(times_b), "ratio": statistics.median(ratios)}


def first_step_pairs(
    make: Callable[[], torch.optim.Optimizer],
    reset: Callable[[], None],
    device: torch.device,
    repeats: int,
    steps: int,
) -> dict[str, float]:
    """The first step against the regular steps of the same optimizer, over ``repeats`` fresh optimizers.

    Each repeat resets the parameters (``reset``), builds a new optimizer, times its first step, takes one untimed
    step and times ``steps`` more; its ratio is the first step over the median of those. Returns the medians of the
    first steps (``first_s``), of the regular steps (``step_s``) and of the per-optimizer ratios (``ratio``): each
    ratio divides two times taken within a second of each other, so the machine's drift and one slow sample (a
    single first step) move it much less than a ratio of rows measured minutes apart.
    """
    firsts, regular, ratios = [], [], []
    for _ in range(repeats):
        reset()
        opt = make()
        _sync(device)
        start = time.perf_counter()
        opt.step()
        _sync(device)
        first = time.perf_counter() - start - getattr(opt, "compile_time_s", 0.0)
        step = time_steps(opt, device, steps, 1)
        firsts.append(first)
        regular.append(step)
        ratios.append(first / step)
        del opt
    return {
        "first_s": statistics.median(firsts),
        "step_s": statistics.median(regular),
        "ratio": statistics.median(ratios),
    }


def time_nonfinite_check(named: list[tuple[str, torch.nn.Parameter]], device: torch.device, steps: int) -> float:
    """Median seconds of the NaN/Inf check of ``nonfinite="skip"`` over every gradient (one host read)."""
    grads = [(name, p.grad) for name, p in named if p.grad is not None]
    times = []
    for _ in range(steps + 1):
        _sync(device)
        start = time.perf_counter()
        unusable_names(grads)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def measure(opt: torch.optim.Optimizer, device: torch.device, steps: int, warmup: int) -> dict[str, object]:
    """Time one optimizer: first step (Gefen: minus compile time), median step, peak extra memory."""
    row: dict[str, object] = {}
    start = time.perf_counter()
    opt.step()
    _sync(device)
    first = time.perf_counter() - start
    compile_s = getattr(opt, "compile_time_s", 0.0)
    triton = opt._backends.loaded("triton") if isinstance(opt, gefen.Gefen) else None
    jit_s = triton.jit_time_s if triton is not None else 0.0
    row["first_step_time_s"] = first - compile_s - jit_s
    row["compile_time_s"] = compile_s
    row["triton_jit_time_s"] = jit_s
    peak = PeakMemory(device)
    peak.start()
    row["opt_step_time_s"] = time_steps(opt, device, steps, max(0, warmup - 1))
    extra = peak.extra_bytes()
    row["peak_extra_memory_bytes"] = extra
    if isinstance(opt, gefen.Gefen):
        row["compiled_signatures"] = len(opt._kernels)
    return row


def main() -> None:
    """Parse arguments, run every optimizer on the same parameter set, print the JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="25m")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per optimizer")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (includes the first step)")
    parser.add_argument(
        "--first-repeats", type=int, default=5, help="fresh Gefen optimizers for ratio_gefen_first_step_vs_step"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--skip-compiled", action="store_true", help="leave out the compiled row")
    parser.add_argument(
        "--skip-muon",
        action="store_true",
        help="leave out the Muon rows (torch's bf16 Newton-Schulz takes minutes on CPUs without AVX-512 BF16)",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    threads = torch.get_num_threads()
    bandwidth = stream_bandwidth(device)

    named = gpt_shaped_params(args.size, device)
    params = [p for _, p in named]
    n_params = sum(p.numel() for p in params)
    # Muon rows: the 2-D hidden weights only (what a Muon hybrid gives Muon), same process, same tensors
    hidden, _ = gefen.split_params_for_muon(named)
    n_hidden = sum(p.numel() for _, p in hidden)
    # name -> (factory, number of parameters it optimizes)
    factories: dict[str, tuple[Callable[[], torch.optim.Optimizer], int]] = {
        "adamw_fused": (lambda: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, fused=True), n_params),
        "adamw_foreach": (lambda: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, foreach=True), n_params),
        "gefen": (lambda: gefen.Gefen(named, lr=1e-3, weight_decay=0.1), n_params),
        "gefen_native": (lambda: gefen.Gefen(named, lr=1e-3, weight_decay=0.1, backend="native"), n_params),
        "gefen_compiled": (lambda: gefen.Gefen(named, lr=1e-3, weight_decay=0.1, backend="compiled"), n_params),
        "gefen_eager": (lambda: gefen.Gefen(named, lr=1e-3, weight_decay=0.1, backend="eager"), n_params),
        "gefen_triton": (lambda: gefen.Gefen(named, lr=1e-3, weight_decay=0.1, backend="triton"), n_params),
        "adamw_fused_1_thread": (lambda: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, fused=True), n_params),
        "gefen_1_thread": (lambda: gefen.Gefen(named, lr=1e-3, weight_decay=0.1), n_params),
        "torch_muon": (lambda: torch.optim.Muon([p for _, p in hidden], lr=1e-3, weight_decay=0.1), n_hidden),
        "gefen_muon": (lambda: gefen.GefenMuon(hidden, lr=1e-3, weight_decay=0.1), n_hidden),
    }
    if args.skip_compiled or device.type not in ("cpu", "cuda"):
        del factories["gefen_compiled"]
    if device.type != "cuda" or importlib.util.find_spec("triton") is None:  # the Triton backend runs on CUDA
        del factories["gefen_triton"]
    torch_muon_fp32 = False
    if args.skip_muon:
        del factories["torch_muon"], factories["gefen_muon"]
    elif device.type == "cpu":  # else torch's scalar bf16 GEMM fallback takes tens of minutes (see below)
        from gefen.cli._optimizers import torch_muon_gemms_in_fp32

        torch_muon_fp32 = torch_muon_gemms_in_fp32()
    if device.type != "cpu":
        del factories["gefen_native"]
    initial = [p.detach().clone() for p in params]
    results = {}
    for name, (make, n_optimized) in factories.items():
        with torch.no_grad():
            for p, v in zip(params, initial):
                p.copy_(v)
        torch.set_num_threads(1 if name.endswith("_1_thread") else threads)
        print(f"[step.py] {name} ...", file=sys.stderr, flush=True)  # progress: the JSON goes to stdout
        opt = make()
        row = measure(opt, device, args.steps, args.warmup)
        torch.set_num_threads(threads)
        row["state_bytes_per_param"] = _state_bytes(opt) / n_optimized
        moved = bytes_moved(opt)
        row["bytes_moved_per_param"] = moved / n_optimized
        row["effective_gb_s"] = moved / row["opt_step_time_s"] / 1e9
        if n_optimized != n_params:
            row["params"] = n_optimized
        results[name] = row
        del opt
    fused_s = results["adamw_fused"]["opt_step_time_s"]
    # The headline ratios: Gefen (default backend) and fused AdamW stepped alternately, so that the machine's drift
    # over the run (frequency, neighbours on a shared host) cannot favour either; 2x the steps of the rows above.
    pairs = {}
    for label, n_threads in (("", threads), ("_1_thread", 1)):
        print(f"[step.py] interleaved adamw_fused / gefen{label} ...", file=sys.stderr, flush=True)
        torch.set_num_threads(n_threads)
        pairs[label] = interleaved(
            lambda: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, fused=True),
            lambda: gefen.Gefen(named, lr=1e-3, weight_decay=0.1),
            device,
            2 * args.steps,
            args.warmup,
        )
    torch.set_num_threads(threads)
    print("[step.py] gefen first steps against their regular steps ...", file=sys.stderr, flush=True)

    def reset() -> None:
        with torch.no_grad():
            for p, v in zip(params, initial):
                p.copy_(v)

    first_pairs = first_step_pairs(
        lambda: gefen.Gefen(named, lr=1e-3, weight_decay=0.1), reset, device, args.first_repeats, args.steps // 2
    )
    print("[step.py] interleaved gefen nonfinite='propagate' / default ...", file=sys.stderr, flush=True)
    check_pair = interleaved(
        lambda: gefen.Gefen(named, lr=1e-3, weight_decay=0.1, nonfinite="propagate"),
        lambda: gefen.Gefen(named, lr=1e-3, weight_decay=0.1),
        device,
        2 * args.steps,
        args.warmup,
    )
    check_s = check_pair["b_s"] - check_pair["a_s"]
    check_eager_s = time_nonfinite_check(named, device, 2 * args.steps)

    def ratio(name: str) -> float | None:
        return results[name]["opt_step_time_s"] / fused_s if name in results else None

    print(
        json.dumps(
            {
                "params": n_params,
                "device": str(device),
                "threads": threads,
                "stream_bandwidth_gb_s": bandwidth,
                "results": results,
                "ratio_gefen_vs_adamw_fused": pairs[""]["ratio"],
                "interleaved": pairs,
                "ratio_gefen_vs_adamw_fused_sequential_rows": ratio("gefen"),
                "ratio_gefen_native_vs_adamw_fused": ratio("gefen_native"),
                "ratio_gefen_compiled_vs_adamw_fused": ratio("gefen_compiled"),
                "ratio_gefen_eager_vs_adamw_fused": ratio("gefen_eager"),
                "ratio_gefen_triton_vs_adamw_fused": ratio("gefen_triton"),
                "ratio_gefen_vs_adamw_fused_1_thread": pairs["_1_thread"]["ratio"],
                "ratio_gefen_first_step_vs_step": first_pairs["ratio"],
                "first_step_pairs": first_pairs,
                "ratio_gefen_muon_vs_torch_muon": results["gefen_muon"]["opt_step_time_s"]
                / results["torch_muon"]["opt_step_time_s"]
                if "torch_muon" in results
                else None,
                "torch_muon_newton_schulz_in_fp32": torch_muon_fp32,
                "nonfinite_check_s": check_s,
                "nonfinite_check_fraction_of_gefen_step": check_s / pairs[""]["b_s"],
                "nonfinite_check_eager_s": check_eager_s,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
