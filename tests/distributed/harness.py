"""Multi-process test harness: run a function on ``world_size`` CPU processes joined by a ``gloo`` process group on
127.0.0.1, under a deadline, so a deadlock fails the test instead of hanging CI.

The function runs as ``fn(rank, world_size, *args)`` in each process (it must be importable: a module-level
function of a test module) and returns a picklable value; :func:`run_world` returns the values by rank.
"""

from __future__ import annotations

import datetime
import gc
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_world", "run_torchrun", "WorldFailed", "free_port"]


class WorldFailed(AssertionError):
    """A rank raised, or the world missed its deadline (deadlock)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# torchrun's own rendezvous can lose the port free_port() picked to another process before it binds it: only that
# failure is retried, every other one fails the test with the ranks' output.
_PORT_TAKEN = ("address already in use", "eaddrinuse", "errno 98")


def run_torchrun(script: Path, ranks: int, *args: str, timeout: float = 240.0, attempts: int = 2) -> str:
    """Run ``python -m torch.distributed.run --nproc-per-node ranks script *args`` on 127.0.0.1 and return stdout.

    One thread per rank (``OMP_NUM_THREADS=1``), ``src/`` on ``PYTHONPATH``. Raises :class:`WorldFailed` with the
    tail of the ranks' stdout/stderr when the run exits non-zero or passes ``timeout`` (seconds); a run that only
    lost its rendezvous port is retried up to ``attempts`` times in all.
    """
    import subprocess

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root / "src")}
    for attempt in range(attempts):
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
        command += ["--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script), *args]
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise WorldFailed(f"torchrun {script.name} passed its {timeout:.0f} s deadline:\n{_tail(exc)}") from None
        if done.returncode == 0:
            return done.stdout
        if attempt + 1 < attempts and any(text in done.stderr.lower() for text in _PORT_TAKEN):
            continue
        raise WorldFailed(f"torchrun {script.name} exited with {done.returncode}:\n{_tail(done)}")
    raise AssertionError("unreachable")


def _tail(done: Any, chars: int = 6000) -> str:
    def text(value: Any) -> str:
        return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")

    return f"--- stdout ---\n{text(done.stdout)[-chars:]}\n--- stderr ---\n{text(done.stderr)[-chars:]}"


def _worker(
    rank: int, world_size: int, port: int, out: str, fn: Callable[..., Any], args: tuple, backend: str = "gloo"
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)  # 2 cores shared by the ranks: no oversubscription
    result: dict[str, Any]
    try:
        if "nccl" in backend:
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=60),
        )
        result = {"ok": fn(rank, world_size, *args)}
    except BaseException as exc:  # reported to the parent, which fails the test
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    finally:
        if dist.is_initialized():
            _teardown(ok="ok" in result)  # result is always bound here: the except clause catches everything
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    # The interpreter's shutdown is skipped: a gloo worker thread can still be releasing the last collective's
    # tensors then, and its request for the GIL during shutdown aborts the process (pytorch/pytorch#190489).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _teardown(ok: bool) -> None:
    """Destroy the process group in step with the other ranks.

    After a successful ``fn``: free what it left in reference cycles (FSDP2 modules and their hooks hold
    communication state), then wait for every rank before destroying the group, so that no rank (rank 0 hosts
    the TCP store) destroys its group while another still uses it. The barrier fails fast (connection closed)
    when another rank failed and already destroyed its group; that rank's error is the one reported.
    """
    if ok:
        gc.collect()
        try:
            dist.barrier()
        except Exception:  # another rank failed: the parent reports its error
            pass
    dist.destroy_process_group()


def run_world(
    fn: Callable[..., Any], world_size: int = 2, *args: Any, timeout_s: float = 120.0, backend: str = "gloo"
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the results by rank.

    ``backend`` is the process group's (``init_process_group``'s string): a CUDA test passes ``"nccl"`` (each rank
    then uses GPU ``rank``) or ``"cpu:gloo,cuda:nccl"``.

    Raises:
        WorldFailed: a rank raised (its traceback in the message), died, or the deadline passed (all ranks are
            killed).
    """
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(
            _worker,
            args=(world_size, free_port(), out, fn, args, backend),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise WorldFailed(f"{fn.__name__} on {world_size} ranks missed its {timeout_s:.0f} s deadline")
        except mp.ProcessRaisedException as exc:
            raise WorldFailed(str(exc)) from None
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
        results = []
        for rank in range(world_size):
            path = Path(out, f"rank{rank}.pkl")
            if not path.exists():
                raise WorldFailed(f"rank {rank} of {fn.__name__} died without a result")
            result = pickle.loads(path.read_bytes())
            if "error" in result:
                raise WorldFailed(f"rank {rank}: {result['error']}\n{result['traceback']}")
            results.append(result["ok"])
        return results
