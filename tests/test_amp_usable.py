"""The usability check of gradients (gefen.amp): the multi-tensor form used on CUDA against the per-gradient one.

Both must give the same answer for every gradient, at the bound and just past it, for NaN/Inf anywhere, for every
dtype, in any mix of dtypes and in the gradients' order. The multi-tensor form is computed here on CPU tensors (torch's
foreach reductions run there too); on CUDA tests/test_cuda.py repeats the comparison on the device.
"""

from __future__ import annotations

import pytest
import torch

from gefen.amp import _usable, usable_bound, usable_flags_multi_tensor


def _bound32(numel: int) -> float:
    return float(torch.tensor(usable_bound(numel), dtype=torch.float32))


def _cases() -> list[torch.Tensor]:
    out = []
    for numel in (1, 7, 1000):
        bound = torch.tensor(_bound32(numel), dtype=torch.float32)
        above = torch.nextafter(bound, torch.tensor(float("inf")))
        for value in (bound, above, -bound, -above):
            g = torch.zeros(numel)
            g[numel // 2] = value
            out.append(g)
    for bad in (float("nan"), float("inf"), float("-inf")):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            g = torch.randn(64).to(dtype)
            g[13] = bad
            out.append(g)
    out += [torch.randn(33).to(dtype) for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64)]
    out += [torch.zeros(0), torch.full((5,), 6.0e4, dtype=torch.float16)]
    return out


def test_multi_tensor_check_equals_the_per_gradient_one() -> None:
    grads = _cases()
    expected = [bool(_usable(g)) for g in grads]
    assert expected.count(False) == 6 + 9  # two values past the bound per size, and every NaN/Inf case
    assert usable_flags_multi_tensor(grads).tolist() == expected


@pytest.mark.parametrize("seed", range(3))
def test_multi_tensor_check_keeps_the_order_of_mixed_dtypes(seed: int) -> None:
    grads = _cases()
    order = torch.randperm(len(grads), generator=torch.Generator().manual_seed(seed)).tolist()
    shuffled = [grads[i] for i in order]
    assert usable_flags_multi_tensor(shuffled).tolist() == [bool(_usable(g)) for g in shuffled]
    assert usable_flags_multi_tensor(shuffled[:1]).tolist() == [bool(_usable(shuffled[0]))]
