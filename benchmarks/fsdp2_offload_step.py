r"""Median ``optimizer.step()`` time of the default Gefen against torch's fused AdamW on the local shards of an FSDP2
model under ``CPUOffloadPolicy``: 2 gloo ranks on 127.0.0.1, one CPU thread each.

The model holds the GPT-shaped parameter set of ``benchmarks/step.py`` (``gpt_shaped_params``: embedding, q/k/v/o,
SwiGLU gate/up/down, RMSNorm weights), is ``fully_shard``-ed with ``CPUOffloadPolicy(pin_memory=False)`` (the only
setting without CUDA), and takes one forward and backward whose gradients are that set's fixed random gradients
(``sum(p * g)``; FSDP's reduce-scatter averages the ranks' equal gradients, so each rank's shard of ``g`` arrives as
a ``Shard(0)`` DTensor gradient on the CPU). Both optimizers are then built on the same DTensor parameters, as a
training script builds them: ``gefen.Gefen(model.named_parameters(), ...)`` with its defaults (``backend="auto"``:
the native kernels on each rank's rows, one all-reduce of the factored column statistics, the block gathers of the
1-D weights, the step's agreement all-reduce) and ``torch.optim.AdamW(..., fused=True)`` (torch's fused CPU kernel
through DTensor's dispatch; no collectives).

They step alternately on the same parameters (gradients are only read): before each timed step every rank meets at
a barrier (untimed), each rank times its own ``step()`` with ``time.perf_counter()``, and the step's time is the
slowest rank's (a MAX all-reduce, untimed), since that rank holds up the next collective of training. After
``--warmup`` untimed pairs (the first includes Gefen's first step: period search, codebook), ``--steps`` pairs are
timed. Prints one JSON object::

    {"params": int, "world_size": int, "threads_per_rank": int, "size": str, "pairs": int, "cpu_count": int,
     "load_average_1m_before": float, "offload_policy": str, "local_shard_device": str,
     "results": {"gefen": {"opt_step_time_s": float, "state_bytes_per_param": float, "backends": {NAME: int}},
                 "adamw_fused": {"opt_step_time_s": float, "state_bytes_per_param": float}},
     "ratio_gefen_vs_adamw_fused": float, "ratio_of_medians": float}

``opt_step_time_s`` is the median over the pairs; ``ratio_gefen_vs_adamw_fused`` the median of the per-pair ratios
(Gefen over AdamW: drifts of the machine hit both alike), ``ratio_of_medians`` the two medians' ratio.
``state_bytes_per_param`` is every rank's optimizer state summed (Gefen: ``state_bytes()``, its codebook once per
rank; AdamW: its moments and step counters), over the model's parameter count. ``backends`` counts the parameters by
the backend that ran Gefen's last step on each rank's shard (``state_report()``'s ``backend``, the same on every
rank: checked). ``load_average_1m_before`` is the machine's 1-minute load average at the start (other work on a
shared machine shows there; with 2 ranks on 2 cores, anything above ~0.5 skews the times). Progress goes to
stderr; no assertion on speed is made here. Every rank and the whole run have deadlines (``--timeout``, seconds):
a hang fails the script instead of blocking it.

Usage: ``python benchmarks/fsdp2_offload_step.py [--size 25m] [--steps 40] [--warmup 3] [--timeout 900]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import torch

WORLD_SIZE = 2
THREADS_PER_RANK = 1  # 2 ranks on a 2-core machine: one thread each, no oversubscription


class _ParameterSet(torch.nn.Module):
    """The GPT-shaped parameters as one module (``.`` in their names becomes ``_``); ``forward`` returns
    ``sum(p * g)`` over them, whose gradient is each parameter's fixed random gradient ``g``."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]]) -> None:
        super().__init__()
        self.grads: dict[str, torch.Tensor] = {}
        for name, p in named:
            key = name.replace(".", "_")
            self.register_parameter(key, torch.nn.Parameter(p.detach().clone()))
            self.grads[key] = p.grad.detach().clone()

    def forward(self) -> torch.Tensor:
        return sum((p * self.grads[name]).sum() for name, p in self.named_parameters())


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    """This rank's optimizer state in bytes (the local tensors of sharded state)."""
    import gefen

    if isinstance(opt, gefen.Gefen):
        return opt.state_bytes()
    total = 0
    for st in opt.state.values():
        for t in st.values():
            if isinstance(t, torch.Tensor):
                t = t.to_local() if hasattr(t, "to_local") else t
                total += t.numel() * t.element_size()
    return total


def _rank_job(rank: int, size: str, steps: int, warmup: int) -> dict[str, Any]:
    """One rank's part: build, shard, one backward, then the interleaved timed steps."""
    import torch.distributed as dist
    from step import gpt_shaped_params  # benchmarks/ is on the path (spawn keeps the parent's sys.path)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    import gefen

    model = _ParameterSet(gpt_shaped_params(size, torch.device("cpu")))
    n_params = sum(p.numel() for p in model.parameters())
    policy = CPUOffloadPolicy(pin_memory=False)
    fully_shard(model, mesh=init_device_mesh("cpu", (WORLD_SIZE,)), offload_policy=policy)  # CPU, GPU or not
    model().backward()
    shards = [p.to_local() for p in model.parameters()]
    devices = sorted({str(t.device) for t in shards} | {str(p.grad.to_local().device) for p in model.parameters()})

    optimizers = {
        "adamw_fused": torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True),
        "gefen": gefen.Gefen(model.named_parameters(), lr=1e-3, weight_decay=0.1),
    }
    slowest = torch.zeros(2, dtype=torch.float64)
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for pair in range(warmup + steps):
        for k, opt in enumerate(optimizers.values()):
            dist.barrier()
            start = time.perf_counter()
            opt.step()
            slowest[k] = time.perf_counter() - start
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if pair >= warmup:
            for k, name in enumerate(optimizers):
                times[name].append(float(slowest[k]))
        if rank == 0 and (pair + 1) % 10 == 0:
            print(f"[fsdp2_offload_step.py] {pair + 1}/{warmup + steps} pairs", file=sys.stderr, flush=True)
    state_bytes = torch.tensor([_state_bytes(opt) for opt in optimizers.values()], dtype=torch.float64)
    dist.all_reduce(state_bytes)
    backends = Counter(row["backend"] for row in optimizers["gefen"].state_report())
    every_rank: list[Any] = [None] * WORLD_SIZE
    dist.all_gather_object(every_rank, sorted(backends.items()))
    if any(other != every_rank[0] for other in every_rank):
        raise RuntimeError(f"the ranks stepped their shards on different backends: {every_rank}")
    return {
        "params": n_params,
        "policy": repr(policy),
        "devices": devices,
        "times": times,
        "state_bytes": dict(zip(optimizers, state_bytes.tolist())),
        "backends": dict(backends),
    }


def _worker(rank: int, port: int, out: str, size: str, steps: int, warmup: int, timeout_s: float) -> None:
    import torch.distributed as dist

    torch.set_num_threads(THREADS_PER_RANK)
    result: dict[str, Any]
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=WORLD_SIZE,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        result = {"ok": _rank_job(rank, size, steps, warmup)}
    except BaseException as exc:  # reported by the parent
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    if dist.is_initialized():
        if "ok" in result:
            dist.barrier()  # rank 0 hosts the store: no rank leaves while another still uses the group
        dist.destroy_process_group()
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    # no interpreter shutdown: a gloo thread still releasing the last collective can abort it (pytorch#190489),
    # as tests/distributed/harness.py notes
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(size: str, steps: int, warmup: int, timeout_s: float) -> list[dict[str, Any]]:
    """Spawn the ranks, wait for them under the deadline, return their results (rank order)."""
    import torch.multiprocessing as mp

    os.environ["OMP_NUM_THREADS"] = str(THREADS_PER_RANK)  # inherited by the spawned ranks
    with tempfile.TemporaryDirectory() as out:
        args = (_free_port(), out, size, steps, warmup, min(timeout_s, 600.0))
        ctx = mp.start_processes(_worker, args=args, nprocs=WORLD_SIZE, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise SystemExit(f"fsdp2_offload_step.py: the ranks missed the {timeout_s:.0f} s deadline")
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
        results = []
        for rank in range(WORLD_SIZE):
            path = Path(out, f"rank{rank}.pkl")
            if not path.exists():
                raise SystemExit(f"fsdp2_offload_step.py: rank {rank} died without a result")
            result = pickle.loads(path.read_bytes())
            if "error" in result:
                raise SystemExit(f"fsdp2_offload_step.py: rank {rank}: {result['error']}\n{result['traceback']}")
            results.append(result["ok"])
        return results


def main() -> None:
    """Parse arguments, run the two ranks, print the JSON object."""
    from step import SIZES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="25m")
    parser.add_argument("--steps", type=int, default=40, help="timed pairs (one step of each optimizer)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed pairs first (includes Gefen's first step)")
    parser.add_argument("--timeout", type=float, default=900.0, help="deadline of the whole run, seconds")
    args = parser.parse_args()
    print(f"[fsdp2_offload_step.py] {WORLD_SIZE} gloo ranks, size {args.size} ...", file=sys.stderr, flush=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    first = _run(args.size, args.steps, args.warmup, args.timeout)[0]  # rank 0's copy: the times are the slowest
    gefen_s, adamw_s = first["times"]["gefen"], first["times"]["adamw_fused"]
    n = first["params"]
    print(
        json.dumps(
            {
                "params": n,
                "world_size": WORLD_SIZE,
                "threads_per_rank": THREADS_PER_RANK,
                "size": args.size,
                "pairs": args.steps,
                "cpu_count": os.cpu_count(),
                "load_average_1m_before": load,
                "offload_policy": first["policy"],
                "local_shard_device": ",".join(first["devices"]),
                "results": {
                    "gefen": {
                        "opt_step_time_s": statistics.median(gefen_s),
                        "state_bytes_per_param": first["state_bytes"]["gefen"] / n,
                        "backends": first["backends"],
                    },
                    "adamw_fused": {
                        "opt_step_time_s": statistics.median(adamw_s),
                        "state_bytes_per_param": first["state_bytes"]["adamw_fused"] / n,
                    },
                },
                "ratio_gefen_vs_adamw_fused": statistics.median(g / a for g, a in zip(gefen_s, adamw_s)),
                "ratio_of_medians": statistics.median(gefen_s) / statistics.median(adamw_s),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
