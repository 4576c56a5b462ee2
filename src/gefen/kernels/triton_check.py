"""The Triton backend's self-check: one small step on a device, compared with the eager reference, before the backend
is trusted there.

Why: the kernels are tested in CI under Triton's interpreter, which runs numpy on the CPU. A GPU brings what the
interpreter cannot show (its division and square-root instructions, flush-to-zero, FP contraction, races between
programs, another Triton version's compiler). Instead of trusting a device it has never run on, ``backend="auto"``
first steps a fixed problem on it, the same bounds the interpreter tests assert, and takes the Triton backend only if
it passes (``backend="triton"`` refuses with the reason). One self-check per device and process, a few milliseconds
with warm Triton caches.

The problem (:func:`self_check`): block jobs with periods 1, 48 and 768 (fp32 and bf16 parameters), a factored job
(period 100, fp16 parameter, bf16 gradient) and GefenMuon's momentum; two steps, then a step with a NaN gradient that
must change nothing. Bounds (those of tests/kernels/test_triton_plan.py, see :mod:`gefen.kernels.triton_plan`): codes,
magnitudes and ``m̂`` bit-identical, second moments within 4 fp32 ulps, parameters within 1 ulp plus 1e-6 of the step.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["self_check", "device_verdict", "random_job", "ulps_apart"]

#: The hyperparameters of the self-check's one group.
_HYPER = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "lr": 1e-2, "weight_decay": 0.1}
#: (kind, elements, period, (R, C) when factored, parameter dtype, gradient dtype) of the self-check's jobs.
_SPECS = (
    ("block", 96, 1, (0, 0), torch.float32, torch.float32),
    ("block", 48 * 6, 48, (0, 0), torch.bfloat16, torch.bfloat16),
    ("factored", 20 * 30, 100, (20, 30), torch.float16, torch.bfloat16),
    ("block", 768 * 2, 768, (0, 0), torch.float32, torch.float16),
    ("momentum", 100 * 4, 100, (0, 0), torch.float32, torch.float32),
)
_SECOND_MOMENT_ULPS = 4
#: Verdicts per device (``str(device)``): ``""`` passed, else why not.
_VERDICTS: dict[str, str] = {}


def device_verdict(device: torch.device) -> str:
    """:func:`self_check` of ``device``, run once per process and remembered."""
    key = str(device)
    if key not in _VERDICTS:
        _VERDICTS[key] = self_check(device)
    return _VERDICTS[key]


def self_check(device: torch.device) -> str:
    """Step the fixed problem (module docstring) with the Triton plan on ``device`` and with the eager reference on the
    CPU, and compare.

    Args:
        device: a CUDA device (or the CPU under ``TRITON_INTERPRET=1``: the tests).

    Returns:
        ``""`` when every bound holds, otherwise the first failure, as a sentence (a compile error or any exception
        included: the backend must not be used then). Never raises.
    """
    try:
        return _compare(torch.device(device))
    except Exception as exc:  # a compile error, a missing driver feature: the backend is not usable here
        return f"the Triton self-check could not run on {device} ({type(exc).__name__}: {exc})"


def random_job(
    kind: str,
    numel: int,
    period: int,
    shape: tuple[int, int],
    pdt: torch.dtype,
    gdt: torch.dtype,
    gen: torch.Generator,
    group: int = 0,
    counter: bool = True,
) -> object:
    """A :class:`~gefen.kernels.triton_plan.TritonJob` on the CPU with random state: some all-zero gradient blocks
    (every fifth), zero magnitudes (every fourth block), gradients spread over several orders of magnitude.

    Args:
        kind: ``"block"``, ``"factored"`` or ``"momentum"``; numel, period: ``N`` and ``P`` (``P`` divides ``N``);
        shape: ``(R, C)`` when factored; pdt, gdt: parameter and gradient dtypes; gen: the random source;
        group: the group-table row; counter: give a momentum job a step counter (block and factored always have one).
    """
    from gefen.kernels.triton_plan import TritonJob

    blocks = numel // period
    grad = torch.randn(numel, generator=gen) * torch.exp(2 * torch.randn(numel, generator=gen)) * 1e-2
    grad.view(blocks, period)[1::5] = 0.0
    scale = torch.rand(blocks, generator=gen) * 0.01
    scale[::4] = 0.0
    codes = torch.randint(0, 256, (blocks, period), generator=gen, dtype=torch.uint8)
    param = None if kind == "momentum" else torch.randn(numel, generator=gen).to(pdt)
    if kind == "factored":
        second: tuple[Tensor, ...] = tuple(torch.rand(n, generator=gen) * 1e-6 for n in shape)
    elif kind == "block":
        second = (torch.rand(blocks, generator=gen) * 1e-6,)
    else:
        second = ()
    out = torch.zeros(numel) if kind == "momentum" else None
    count = torch.zeros(1, dtype=torch.int64) if counter or kind != "momentum" else None
    return TritonJob(kind, grad.to(gdt), codes, scale, period, group, param, second, shape, out, count)


def _problem(seed: int = 0) -> tuple[object, list[object]]:
    """The nearest-code table and the CPU jobs of the self-check."""
    from gefen.math.codebook import HISTOGRAM_BINS, accumulate_histogram_, fit_codebook
    from gefen.math.lookup import build_nearest_table

    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(HISTOGRAM_BINS, dtype=torch.int64)
    sample = torch.randn(64, 512, generator=gen) * torch.exp(torch.randn(64, 1, generator=gen))
    accumulate_histogram_(counts, sample.reshape(-1), 512)
    table = build_nearest_table(fit_codebook(counts))
    return table, [random_job(*spec, gen) for spec in _SPECS]


def _moved(job: object, device: torch.device) -> object:
    from gefen.kernels.triton_plan import TritonJob

    def to(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.to(device, copy=True)

    j: TritonJob = job  # type: ignore[assignment]
    second = tuple(t.to(device, copy=True) for t in j.second)
    return TritonJob(j.kind, to(j.grad), to(j.codes), to(j.scale), j.period, j.group, to(j.param), second, j.shape,
                     to(j.out), to(j.counter))  # fmt: skip


def _tensors(job: object) -> list[Tensor]:
    j = job
    return [t for t in (j.codes, j.scale, j.param, *j.second, j.out, j.counter) if t is not None]  # type: ignore[attr-defined]


def _compare(device: torch.device) -> str:
    from gefen.kernels.eager import reference_step
    from gefen.kernels.triton_plan import GROUP_FIELDS, build_plan

    table, reference = _problem()
    jobs = [_moved(job, device) for job in reference]
    dev_table = [t.to(device) for t in (table.codebook, table.lut, table.thresholds)]
    plan = build_plan(jobs, *dev_table, table.steps)  # type: ignore[arg-type]
    groups = torch.tensor([[_HYPER[name] for name in GROUP_FIELDS]], dtype=torch.float64, device=device)
    for step in (1, 2):
        before = [None if j.param is None else j.param.clone() for j in reference]  # type: ignore[attr-defined]
        flags = plan.run(groups, check=True).cpu()
        if flags.tolist() != [1] * len(jobs):
            return f"step {step} of finite gradients was refused on {device} (flags {flags.tolist()})"
        for i, ref in enumerate(reference):
            r = ref  # type: ignore[assignment]
            reference_step(r.kind, grad=r.grad, codes=r.codes, scale=r.scale, table=table, period=r.period,
                           param=r.param, second=r.second, out=r.out, shape=r.shape, step=step, **_HYPER)  # fmt: skip
            r.counter += 1
            failure = _difference(jobs[i], r, before[i])
            if failure:
                return f"step {step}, job {i} ({r.kind}, period {r.period}) on {device}: {failure}"
            for ours, theirs in zip(_tensors(r), _tensors(jobs[i])):  # the next step starts from the device's state
                ours.copy_(theirs.cpu())
    kept = [t.clone() for job in jobs for t in _tensors(job)]
    jobs[2].grad.view(-1)[7] = float("nan")  # type: ignore[attr-defined]
    flags = plan.run(groups, check=True).cpu()
    if flags.tolist()[2] != 0 or int(plan.applied) != 0:  # type: ignore[arg-type]
        return f"a NaN gradient was not flagged on {device} (flags {flags.tolist()})"
    after = [t for job in jobs for t in _tensors(job)]
    if not all(torch.equal(a, b) for a, b in zip(kept, after)):
        return f"a step with a NaN gradient changed the state on {device}"
    return ""


def ulps_apart(a: Tensor, b: Tensor) -> int:
    """Largest distance in fp32 ulps between two fp32 tensors of finite values (ordered bit patterns); 0 when empty."""

    def key(x: Tensor) -> Tensor:
        bits = x.contiguous().view(torch.int32).to(torch.int64)
        return torch.where(bits >= 0, bits, -(bits & 0x7FFFFFFF))

    return int((key(a) - key(b)).abs().max()) if a.numel() else 0


def _difference(ours: object, ref: object, before: Tensor | None) -> str:
    """The first bound that ``ours`` (on the device) breaks against ``ref`` (the CPU reference), or ``""``."""
    o, r = ours, ref
    if not torch.equal(o.codes.cpu(), r.codes):  # type: ignore[attr-defined]
        return "first-moment codes differ from the eager reference"
    if not torch.equal(o.scale.cpu(), r.scale):  # type: ignore[attr-defined]
        return "block magnitudes differ from the eager reference"
    if r.out is not None and not torch.equal(o.out.cpu(), r.out):  # type: ignore[attr-defined]
        return "the momentum m-hat differs from the eager reference"
    for a, b in zip(o.second, r.second):  # type: ignore[attr-defined]
        if ulps_apart(a.cpu(), b) > _SECOND_MOMENT_ULPS:
            return f"a second moment is {ulps_apart(a.cpu(), b)} ulps from the eager reference"
    if r.param is not None and before is not None:  # type: ignore[attr-defined]
        p, q = o.param.cpu().float(), r.param.float()  # type: ignore[attr-defined]
        inf = torch.tensor(float("inf"), dtype=r.param.dtype)  # type: ignore[attr-defined]
        ulp = torch.nextafter(r.param.abs(), inf).float() - q.abs()  # type: ignore[attr-defined]
        bound = ulp + 1e-6 * (q - before.float()).abs()
        if not bool(((p - q).abs() <= bound).all()):
            off, most = float((p - q).abs().max()), float(bound.max())
            return f"parameters are {off:.3g} from the eager reference (bound {most:.3g})"
    if int(o.counter) != int(r.counter):  # type: ignore[attr-defined]
        return "the step counter did not advance"
    return ""
