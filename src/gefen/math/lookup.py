"""O(1) nearest-code search: exact decision thresholds plus a 4096-bucket lookup table (algorithm.md §4.9).

The nearest-code rule of §4.8 (``gefen.math.codebook.nearest_code``: lower bound, then the fp32 distance
comparison with ties to the lower index) is a monotone step function of the fp32 input ``u`` on ``[-1, 1]``.
So it is fully described by ``K - 1`` fp32 *thresholds* ``t_k = max{u : nearest(u) <= k}``, found once per
codebook by bisection over the ordered fp32 bit patterns using that very rule, and then
``nearest(u) = #{k : t_k < u}``. Counting is O(1): the bucket ``b = clamp(floor((u + 1)·2048), 0, 4095)``
(fp32) tells how many thresholds lie in earlier buckets (``lut[b]``), and at most ``steps`` further compares
against thresholds inside bucket ``b`` finish the count. Because the thresholds come from the reference rule
itself, the result equals ``nearest_code`` for every fp32 ``u`` in ``[-1, 1]``, bit for bit, including within
one ulp of a midpoint (where a plain "compare with the midpoint" shortcut would flip).

Values outside ``[-1, 1]`` never occur (``u = m / max|m|``) and are clamped to the end codes.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

__all__ = ["LOOKUP_BUCKETS", "NearestCodeTable", "build_nearest_table", "nearest_code_fast", "gather"]

#: Number of buckets over ``[-1, 1]`` (bucket width 2**-11), as in algorithm.md §4.9.
LOOKUP_BUCKETS = 4096


class NearestCodeTable(NamedTuple):
    """Everything :func:`nearest_code_fast` needs for one codebook, on one device.

    Attributes:
        thresholds: (K - 1 + steps,) fp32; ``t_k`` ascending, padded with ``+inf``.
        lut: (4097,) int32; ``lut[b]`` = number of thresholds whose bucket is ``< b``.
        steps: maximum number of thresholds below 1 in one bucket (compares after the table look-up).
        codebook: (K,) fp32, the codebook the table was built from.
    """

    thresholds: Tensor
    lut: Tensor
    steps: int
    codebook: Tensor


def _bucket(v: Tensor) -> Tensor:
    """``clamp(floor((v + 1)·2048), 0, 4095)`` in fp32 arithmetic, as int32 (v >= -1, so trunc == floor)."""
    return (v + 1.0).mul_(LOOKUP_BUCKETS / 2).to(torch.int32).clamp_(0, LOOKUP_BUCKETS - 1)


@torch.no_grad()
def build_nearest_table(codebook: Tensor) -> NearestCodeTable:
    """Exact thresholds and bucket table of a codebook.

    Args:
        codebook: (K,) fp32, non-decreasing, ``K >= 1``, on any device.

    Returns:
        :class:`NearestCodeTable` on ``codebook.device``.

    Source: algorithm.md §4.8 (rule), §4.9 (bucket table).
    """
    cpu = codebook.detach().to("cpu", torch.float32).contiguous()
    k = cpu.numel()
    thresholds = _thresholds(cpu.numpy())
    # the counting in numpy: a dozen small torch ops cost ~0.5 ms, once per codebook but inside the first step
    buckets = _bucket(torch.from_numpy(thresholds)).numpy().astype(np.int64)
    lut = np.zeros(LOOKUP_BUCKETS + 1, dtype=np.int32)
    lut[1:] = np.cumsum(np.bincount(buckets, minlength=LOOKUP_BUCKETS))
    # Thresholds at +1 (trailing copies of the +1 code) are never below an input u <= 1: no compare needed.
    below_one = np.bincount(buckets[thresholds < 1.0], minlength=LOOKUP_BUCKETS)
    steps = int(below_one.max()) if k > 1 else 0
    padded = np.concatenate([thresholds, np.full(steps, np.inf, dtype=np.float32)])
    dev = codebook.device
    return NearestCodeTable(
        torch.from_numpy(padded).to(dev), torch.from_numpy(lut).to(dev), steps, codebook.detach().to(torch.float32)
    )


def _nearest_np(u: np.ndarray, codebook: np.ndarray) -> np.ndarray:
    """:func:`gefen.math.codebook.nearest_code` in numpy (the same lower bound and float32 distance comparison,
    ties to the lower index): the bisection below calls it 33 times on K - 1 values, where torch's per-call cost
    would dominate."""
    r = np.minimum(np.searchsorted(codebook, u, side="left"), codebook.size - 1)
    left = np.maximum(r - 1, 0)
    return np.where(np.abs(u - codebook[left]) <= np.abs(u - codebook[r]), left, r)


def _thresholds(codebook: np.ndarray) -> np.ndarray:
    """``t_k = max{u in [-1, 1] : nearest(u) <= k}`` for ``k < K - 1`` (float32), by bisection over the ordered
    float32 bit patterns (keys): ``nearest(key -> u)`` is monotone in the key, ``lo`` always satisfies the bound
    and ``hi + 1`` never does. Each bracket starts as the 32 keys around the midpoint of codes ``k`` and ``k + 1``
    (where the rule's rounding puts the threshold), proved by two evaluations; a bracket that fails its proof
    (e.g. repeated codes) starts from the whole of [-1, 1]. The bisection stops when every bracket is one key."""
    k = codebook.size
    ks = np.arange(k - 1)
    bottom, top = (int(key) for key in _key_np(np.array([-1.0, 1.0], dtype=np.float32)))
    centre = _key_np(((codebook[:-1].astype(np.float64) + codebook[1:]) / 2).astype(np.float32))
    lo, hi = np.clip(centre - 16, bottom, top), np.clip(centre + 16, bottom, top)
    lo = np.where(_nearest_np(_float_np(lo), codebook) <= ks, lo, bottom)
    above = np.minimum(hi + 1, top)
    hi = np.where((hi < top) & (_nearest_np(_float_np(above), codebook) > ks), hi, top)
    while bool((hi > lo).any()):  # at most 33 rounds over ~2**31 keys; ~6 from proved brackets
        mid = (lo + hi + 1) // 2
        ok = _nearest_np(_float_np(mid), codebook) <= ks
        lo = np.where(ok, mid, lo)
        hi = np.where(ok, hi, mid - 1)
    return _float_np(lo)


def _key_np(x: np.ndarray) -> np.ndarray:
    """The ordered keys (int64) of float32 values: same order as the values, adjacent floats at adjacent keys."""
    bits = x.astype(np.float32).view(np.int32).astype(np.int64)
    return np.where(bits >= 0, bits, -(bits & 0x7FFFFFFF))


def _float_np(key: np.ndarray) -> np.ndarray:
    """Inverse of the key map (:func:`_key_np`: adjacent floats -> adjacent keys): int64 keys -> float32."""
    bits = np.where(key >= 0, key, (-key) | 0x80000000).astype(np.int64) & 0xFFFFFFFF
    return bits.astype(np.uint32).view(np.float32)


def nearest_code_fast(u: Tensor, table: NearestCodeTable) -> Tensor:
    """Nearest codebook index of every element, identical to ``nearest_code`` on ``[-1, 1]``.

    Args:
        u: fp32, any shape, values in ``[-1, 1]`` (normalised first moment), on the table's device.
        table: from :func:`build_nearest_table`.

    Returns:
        int32 indices, the shape of ``u``.

    Source: algorithm.md §4.8, §4.9.
    """
    index = gather(table.lut, _bucket(u))
    for _ in range(table.steps):
        index += gather(table.thresholds, index) < u
    return index


def gather(values: Tensor, index: Tensor) -> Tensor:
    """``values[index]`` for a small 1-D table (``index_select`` is ~2x faster than advanced indexing on CPU)."""
    return torch.index_select(values, 0, index.reshape(-1)).view(index.shape)
