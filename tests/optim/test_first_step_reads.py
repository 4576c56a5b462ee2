"""The first step's host reads, where the period search runs on torch's operations (a GPU's gradients; here the CPU
with ``backend="eager"``, the same code): a fixed number per step, not a few per parameter.

A host read is every ``.item()`` / ``bool()`` / ``int()`` of a tensor (``aten._local_scalar_dense``, seen by a
TorchDispatchMode; not of the int64 step counters, which are CPU tensors on a GPU too) and every ``tolist()`` /
``cpu()`` (counted by wrapping them): on a GPU each one waits for the device. The periods and codebook must be those
of the per-parameter reference (gefen.math.period.first_period, gefen.math.codebook.accumulate_histogram_).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gefen
from gefen.math.codebook import HISTOGRAM_BINS, accumulate_histogram_, fit_codebook
from gefen.math.period import first_period, layout_period
from gefen.state import PERIOD


class _Reads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._local_scalar_dense.default:
            counter = args[0].dtype == torch.int64 and args[0].dim() == 0
            self.reads += not counter  # the step counters live on the CPU on a GPU too (capturable=False)
        return func(*args, **(kwargs or {}))


def _model(layers: int) -> list[tuple[str, torch.nn.Parameter]]:
    gen = torch.Generator().manual_seed(layers)
    params = []
    for i in range(layers):
        params.append((f"{i}.weight", torch.nn.Parameter(torch.randn(48, 64, generator=gen))))
        params.append((f"{i}.bias", torch.nn.Parameter(torch.randn(48, generator=gen))))
    return params


def _first_step_reads(layers: int, monkeypatch: pytest.MonkeyPatch) -> tuple[int, list, gefen.Gefen]:
    params = _model(layers)
    gen = torch.Generator().manual_seed(7)
    for _, p in params:
        rows = torch.rand(p.shape[0], *([1] * (p.dim() - 1)), generator=gen) * 3
        p.grad = torch.randn(p.shape, generator=gen) * rows
    opt = gefen.Gefen(params, lr=1e-2, backend="eager", nonfinite="propagate")
    calls = []
    for method in ("tolist", "cpu"):
        original = getattr(torch.Tensor, method)

        def counted(self, *args, _original=original, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(1)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counted)
    with _Reads() as mode:
        opt.step()
    monkeypatch.undo()
    return mode.reads + len(calls), params, opt


def test_first_step_reads_do_not_grow_with_the_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    few, _, _ = _first_step_reads(2, monkeypatch)
    many, params, opt = _first_step_reads(12, monkeypatch)
    assert many == few, f"{few} host reads for 4 parameters, {many} for 24"
    assert few <= 8  # the preflight's check, the periods (cpu + tolist), the histogram, the zero code's (host) reads
    counts = torch.zeros(HISTOGRAM_BINS, dtype=torch.int64)
    for _, p in params:  # the periods and the codebook of the reference, parameter by parameter
        period = layout_period(first_period(p.grad), tuple(p.shape))
        assert int(opt.state[p][PERIOD]) == period
        accumulate_histogram_(counts, p.grad, period)
    assert torch.equal(opt.codebook, fit_codebook(counts))
