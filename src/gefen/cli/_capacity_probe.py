"""One ``gefen capacity`` candidate: train a model for a few steps in a child process under a memory limit.

The parent (:func:`run_probe`) starts ``python -m gefen.cli._capacity_probe SPEC`` and, on the CPU, watches the
child's resident-set high-water mark (``VmHWM`` in ``/proc/PID/status``, which also catches a spike between two
looks) and kills it the moment it passes the budget: the budget is enforced, not only compared afterwards. On
CUDA the child caps its own allocator (``torch.cuda.set_per_process_memory_fraction``) and reports an
out-of-memory error. Whatever happens to the child (killed, out of memory, an exception, a hang) comes back as an
:class:`gefen.cli._capacity_search.Outcome`; the command never goes down with it.

The child (:func:`main`) builds the model (fp32 weights: the master weights), its optimizer, and runs ``steps``
full training steps on random byte windows: forward (optionally under bf16 autocast, optionally with activation
checkpointing per block), backward, ``optimizer.step()``, ``zero_grad(set_to_none=True)``. It prints one JSON
line per phase, so a stopped child still says how far it got.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gefen.cli._capacity_search import FamilyMember, Outcome

__all__ = ["ProbeSpec", "main", "outcome_from_events", "read_peak_rss", "run_probe"]

#: Exit status of a child whose allocation failed (CUDA or CPU allocator out of memory).
EXIT_OOM = 3
_POLL_S = 0.02


@dataclass(frozen=True)
class ProbeSpec:
    """Everything one child needs (passed as JSON on its command line).

    Attributes:
        optimizer: a name of :data:`gefen.cli._capacity_optimizers.CAPACITY_OPTIMIZERS`.
        d_model, n_layers, d_ff: the model (heads of 64 channels).
        budget_bytes: the memory limit, bytes.
        device: ``"cpu"`` or ``"cuda"`` (``"cuda:N"``).
        batch_size, seq_len: tokens per step (sequences x bytes).
        steps: training steps to run.
        threads: torch threads (CPU).
        autocast: ``"bf16"`` or ``"none"``.
        checkpoint_activations: recompute each block in backward (``torch.utils.checkpoint``).
        seed: model and data seed.
    """

    optimizer: str
    d_model: int
    n_layers: int
    d_ff: int
    budget_bytes: int
    device: str = "cpu"
    batch_size: int = 1
    seq_len: int = 128
    steps: int = 3
    threads: int = 1
    autocast: str = "none"
    checkpoint_activations: bool = False
    seed: int = 0


def read_peak_rss(pid: int) -> int | None:
    """Resident-set high-water mark of process ``pid`` in bytes (Linux ``VmHWM``), ``None`` where unreadable."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return None


def _events(path: Path) -> list[dict[str, Any]]:
    events = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events


def outcome_from_events(
    member: FamilyMember,
    events: list[dict[str, Any]],
    returncode: int | None,
    limit: int,
    stopped_by_us: str | None,
    watched_peak: int | None,
    seconds: float,
    stderr_tail: str = "",
) -> Outcome:
    """Classify a finished child from its JSON lines and its exit.

    Args:
        member: the model it ran.
        events: its JSON lines (``{"event": "phase"|"step"|"done"|"oom"|"error", ...}``).
        returncode: its exit status (negative: killed by that signal), ``None`` if it never started.
        limit: the budget it ran under, bytes.
        stopped_by_us: ``"over_budget"`` or ``"timeout"`` when the parent killed it, else ``None``.
        watched_peak: the largest high-water mark the parent saw, bytes (``None`` where not watched).
        seconds: wall time.
        stderr_tail: the end of its stderr, for the detail of an unexpected failure.

    Returns:
        the :class:`Outcome` (``"fit"`` only for a clean exit after every step with finite losses and a peak
        within ``limit``).
    """
    steps = [e for e in events if e.get("event") == "step"]
    losses = tuple(float(e["loss"]) for e in steps)
    phase = next((e["phase"] for e in reversed(events) if e.get("event") == "phase"), "start")
    done = next((e for e in events if e.get("event") == "done"), None)
    common = {"member": member, "limit_bytes": limit, "steps": len(steps), "losses": losses, "seconds": seconds}
    if stopped_by_us == "over_budget":
        return Outcome(status="over_budget", peak_bytes=watched_peak, phase=phase,
                       detail=f"passed the budget during {phase}", **common)  # fmt: skip
    if stopped_by_us == "timeout":
        return Outcome(status="timeout", peak_bytes=watched_peak, phase=phase,
                       detail=f"still running after {seconds:.0f} s, during {phase}", **common)  # fmt: skip
    oom = next((e for e in events if e.get("event") == "oom"), None)
    if oom is not None or returncode == EXIT_OOM:
        message = (oom or {}).get("message", "out of memory")
        return Outcome(status="oom", peak_bytes=(oom or {}).get("peak_bytes", watched_peak), phase=phase,
                       detail=f"out of memory during {phase}: {message}", **common)  # fmt: skip
    if returncode is not None and returncode < 0:
        name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else str(-returncode)
        why = " (most likely the system's OOM killer: the machine or container ran out of memory)"
        why = why if -returncode == signal.SIGKILL else ""
        return Outcome(status="killed", peak_bytes=watched_peak, phase=phase,
                       detail=f"killed by {name}{why} during {phase}", **common)  # fmt: skip
    error = next((e for e in events if e.get("event") == "error"), None)
    if done is None or returncode != 0:
        detail = error["message"] if error else (stderr_tail.strip().splitlines() or ["exited without a result"])[-1]
        return Outcome(status="error", peak_bytes=watched_peak, phase=phase,
                       detail=f"failed during {phase} (exit {returncode}): {detail}", **common)  # fmt: skip
    peak = max(int(done["peak_bytes"]), watched_peak or 0)
    if not all(math.isfinite(loss) for loss in losses):
        return Outcome(status="error", peak_bytes=peak, phase="done",
                       detail=f"a loss was not finite: {losses}", **common)  # fmt: skip
    extra = {k: float(v) for k, v in done.items() if k not in ("event", "peak_bytes", "state_bytes")}
    status = "fit" if peak <= limit else "over_budget"
    detail = "" if status == "fit" else "finished, but its peak passed the budget"
    return Outcome(status=status, peak_bytes=peak, state_bytes=int(done["state_bytes"]), phase="done",
                   detail=detail, extra=extra, **common)  # fmt: skip


def _die_with_parent() -> None:
    """In the child before ``exec`` (Linux): have the kernel SIGKILL it when the parent dies, however the parent
    ends (``kill -9`` included), so no run outlives the watch on its budget."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def run_probe(spec: ProbeSpec, member: FamilyMember, timeout_s: float = 3600.0) -> Outcome:
    """Train ``member`` as ``spec`` says in a child process and classify what happened.

    Args:
        spec: the run (its model fields must be ``member``'s).
        member: the family model.
        timeout_s: wall-clock limit of the child, seconds.

    Returns:
        the child's :class:`Outcome`; never raises for anything the child does.
    """
    watch = not spec.device.startswith("cuda") and read_peak_rss(os.getpid()) is not None
    with tempfile.TemporaryDirectory(prefix="gefen-capacity-") as folder:
        out, err = Path(folder, "out"), Path(folder, "err")
        env = {**os.environ, "OMP_NUM_THREADS": str(spec.threads), "PYTHONUNBUFFERED": "1"}
        start = time.perf_counter()
        with out.open("wb") as stdout, err.open("wb") as stderr:
            child = subprocess.Popen(
                [sys.executable, "-m", "gefen.cli._capacity_probe", json.dumps(asdict(spec))],
                stdout=stdout, stderr=stderr, env=env,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )  # fmt: skip
            stopped, peak = None, None
            try:
                while child.poll() is None:
                    if watch:
                        level = read_peak_rss(child.pid)
                        peak = max(peak or 0, level or 0)
                        if peak > spec.budget_bytes:
                            stopped = "over_budget"
                    if stopped is None and time.perf_counter() - start > timeout_s:
                        stopped = "timeout"
                    if stopped is not None:
                        break
                    time.sleep(_POLL_S)
            finally:  # stopped, or Ctrl-C / an error here: the child never outlives its watch
                if child.poll() is None:
                    child.kill()
                    child.wait()
        seconds = time.perf_counter() - start
        tail = err.read_text(errors="replace")[-2000:]
        return outcome_from_events(member, _events(out), child.returncode, spec.budget_bytes, stopped,
                                   peak if watch else None, seconds, tail)  # fmt: skip


def _emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def _own_peak_bytes(device: str) -> int:
    """This process's peak memory: CUDA ``max_memory_allocated``, else the resident-set high-water mark."""
    import torch

    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated(device))
    peak = read_peak_rss(os.getpid())
    if peak is not None:
        return peak
    try:
        import resource
    except ImportError:  # Windows: no peak to read, and a run without one must not pass for a fit
        raise RuntimeError("this system reports no peak resident set (no /proc, no resource module)") from None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def _is_oom(error: BaseException) -> bool:
    import torch

    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(error)
    return "can't allocate memory" in text or "out of memory" in text.lower()


def _train(spec: ProbeSpec) -> None:
    import torch
    from torch.utils.checkpoint import checkpoint

    from gefen.cli._capacity_optimizers import CAPACITY_OPTIMIZERS
    from gefen.cli._model import ByteTransformer, ModelConfig
    from gefen.cli._optimizers import state_bytes

    torch.set_num_threads(spec.threads)
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, spec.budget_bytes / total), device)
    _emit(event="phase", phase="build")
    torch.manual_seed(spec.seed)
    config = ModelConfig(spec.d_model, spec.n_layers, spec.d_model // 64, spec.d_ff, context_len=spec.seq_len)
    with device:
        model = ByteTransformer(config)
    if spec.checkpoint_activations:
        for block in model.blocks:
            block.forward = _checkpointed(block.forward, checkpoint)  # type: ignore[method-assign]
    _emit(event="phase", phase="optimizer")
    spec_of = CAPACITY_OPTIMIZERS[spec.optimizer]
    optimizer = spec_of.factory(model, spec_of.lr)
    generator = torch.Generator().manual_seed(spec.seed)
    dtype = torch.bfloat16 if spec.autocast == "bf16" else None
    for step in range(1, spec.steps + 1):
        _emit(event="phase", phase=f"step {step}")
        batch = torch.randint(0, 256, (spec.batch_size, spec.seq_len + 1), generator=generator).to(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = model.loss(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        _emit(event="step", step=step, loss=float(loss), seconds=time.perf_counter() - start)
    done: dict[str, Any] = {"peak_bytes": _own_peak_bytes(spec.device), "state_bytes": state_bytes(optimizer)}
    if device.type == "cuda":
        done["max_memory_reserved"] = int(torch.cuda.max_memory_reserved(device))
    _emit(event="done", **done)


def _checkpointed(forward: Any, checkpoint: Any) -> Any:
    def run(x: Any, cos: Any, sin: Any) -> Any:
        return checkpoint(forward, x, cos, sin, use_reentrant=False)

    return run


def main(argv: list[str] | None = None) -> int:
    """Child entry point: ``python -m gefen.cli._capacity_probe '<ProbeSpec as JSON>'``; returns the exit status
    (0 done, :data:`EXIT_OOM` out of memory, 1 any other error, reported as a JSON ``error`` line)."""
    args = sys.argv[1:] if argv is None else argv
    spec = ProbeSpec(**json.loads(args[0]))
    try:
        _train(spec)
    except BaseException as error:  # noqa: BLE001 - every failure is reported to the parent as a JSON line
        if _is_oom(error):
            try:
                peak = _own_peak_bytes(spec.device)
            except Exception:  # noqa: BLE001
                peak = None
            _emit(event="oom", message=str(error).splitlines()[0][:300] if str(error) else type(error).__name__,
                  peak_bytes=peak)  # fmt: skip
            return EXIT_OOM
        first_line = str(error).splitlines()[0][:300] if str(error) else ""
        _emit(event="error", message=f"{type(error).__name__}: {first_line}")
        raise
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
