"""The per-step record (gefen.kernels.scalars.StepScalars) and the native record's layout check."""

from __future__ import annotations

import math

import pytest
import torch

from gefen.kernels import native
from gefen.kernels.scalars import APPLY, COMPILED_LAYOUT, NATIVE_SCALAR_FIELDS, StepScalars

needs_native = pytest.mark.skipif(not native.native_status().available, reason="native library not built")


@pytest.mark.parametrize("factored", [False, True])
@pytest.mark.parametrize("step", [1, 2, 17, 10_000])
def test_step_constants_follow_algorithm_formulas(factored: bool, step: int) -> None:
    """Each constant from §6.2 steps 2-4 / §6.4 steps 3-5, computed here by hand in float64."""
    beta1, beta2, eps, lr, wd = 0.9, 0.999, 1e-8, 3e-4, 0.1
    values = StepScalars(beta1, beta2, eps, lr, wd).at(step, factored)
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    assert values["w"] == 1 - beta1 and values["one_minus_beta2"] == 1 - beta2
    assert values["decay"] == 1 - lr * wd
    assert values["bc1"] == bc1 and values["bc2"] == bc2
    assert values["root_bc2"] == math.sqrt(bc2) and values["inv_bc1"] == 1 / bc1
    assert values["step"] == (-lr * (1 / bc1) if factored else -lr)


@pytest.mark.parametrize("factored", [False, True])
def test_compiled_row_on_device_equals_host_row(factored: bool) -> None:
    """The device serialisation (capturable) and the host one give the same fp32 row, bit for bit."""
    record = StepScalars(0.9, 0.95, 1e-6, 0.0, 0.01)
    for step in (1, 5, 123):
        host = torch.tensor(_row(record, step, factored, 2e-3), dtype=torch.float32)
        device = record.compiled_row_on_device(torch.tensor(step), 2e-3, factored)
        lr = torch.tensor([2e-3], dtype=torch.float64)
        tensor_lr = record.compiled_row_on_device(torch.tensor(step), lr, factored)
        assert torch.equal(host, device) and torch.equal(host, tensor_lr)
        assert host.numel() == len(COMPILED_LAYOUT) and host[APPLY] == 1.0


def _row(record: StepScalars, step: int, factored: bool, lr: float) -> list[float]:
    return StepScalars(record.beta1, record.beta2, record.eps, lr, record.weight_decay).compiled_row(step, factored)


def test_native_fields_are_the_compiled_constants() -> None:
    """The C record and the compiled row serialise one record: every shared constant is the same float."""
    record = StepScalars(0.8, 0.99, 1e-8, 1e-3, 0.05)
    for kind, factored in (("block", False), ("factored", True)):
        fields = dict(zip(NATIVE_SCALAR_FIELDS, record.native_fields(7, kind)))
        names = (pair[1] if factored else pair[0] for pair in COMPILED_LAYOUT)
        row = dict(zip(names, record.compiled_row(7, factored)))
        for name in ("w", "beta2", "one_minus_beta2", "eps", "decay", "step"):
            assert fields[name] == row[name], name
        assert fields["lerp_high"] == 0  # fp32(1 - 0.8) < 0.5
    assert StepScalars(0.3).native_fields(1, "momentum")[0] == 1  # w = 0.7 takes torch's second lerp formula


@needs_native
def test_exported_layout_is_what_the_records_fill() -> None:
    """The library's exported record (names, offsets, sizes) is the numpy dtype the records are built in."""
    fields = native._exported_fields(native._require())
    assert native.layout_mismatch(fields) == ""
    dtype = native.record_dtype()
    assert dtype.names == native.RECORD_FIELDS
    for name, offset, size, _kind in fields[:-1]:
        assert dtype.fields[name][1] == offset and dtype.fields[name][0].itemsize == size
    assert dtype.itemsize == fields[-1][1]
    assert native.error_codes()["ERR_UNUSABLE"] < 0 and native.error_codes()["OK"] == 0


@needs_native
def test_layout_mismatch_names_the_field() -> None:
    fields = native._exported_fields(native._require())
    renamed = [("momentum_weight", *fields[21][1:]) if i == 21 else f for i, f in enumerate(fields)]
    assert "'momentum_weight' where this gefen fills 'w'" in native.layout_mismatch(renamed)
    swapped = list(fields)
    swapped[0], swapped[1] = swapped[1], swapped[0]
    assert "field 0" in native.layout_mismatch(swapped)
    shorter = fields[:-2] + fields[-1:]
    assert "'(end)' where this gefen fills 'counter'" in native.layout_mismatch(shorter)
    narrow = [(n, o, 4, "q") if n == "numel" else (n, o, s, k) for n, o, s, k in fields]
    assert "'numel' has type 'q' of 4 bytes" in native.layout_mismatch(narrow)
    small = fields[:-1] + [("", fields[-1][1] - 8, 0, "")]
    assert "less than its fields'" in native.layout_mismatch(small)


@needs_native
def test_a_library_whose_record_differs_is_refused_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Change the Python side of the record (one field renamed): loading the real library is refused, naming it."""
    changed = tuple("learning_rate" if name == "step" else name for name in native.RECORD_FIELDS)
    monkeypatch.setattr(native, "RECORD_FIELDS", changed)
    lib, status = native._load.__wrapped__()
    assert lib is None and not status.available
    assert "field 'step' where this gefen fills 'learning_rate'" in status.reason and "reinstall" in status.reason
