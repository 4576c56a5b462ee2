"""Mixed precision: the optimizer side of ``torch.amp.GradScaler``'s protocol, and the non-finite gradient check.

``GradScaler.step(optimizer)`` has two paths (torch's ``torch/amp/grad_scaler.py``):

* **ordinary** — the optimizer's ``_step_supports_amp_scaling`` is false: the scaler unscales the gradients itself
  and does not call ``step()`` at all when it found an Inf/NaN. Used for fp32 (master) and bf16 gradients.
* **optimizer-side** — the property is true: the scaler only measures ``found_inf`` (it refuses to unscale true
  fp16 gradients), sets ``optimizer.found_inf`` (1-element fp32) and ``optimizer.grad_scale`` (1-element fp32, or
  ``None`` when the user already called ``scaler.unscale_``) and calls ``step()``, which must skip on overflow and
  otherwise unscale before using the gradients.

Gefen optimizers report the property true exactly when some present gradient is fp16, so everything else stays on
the ordinary path (where Accelerate/Trainer also see ``step_was_skipped``). Source: hardening.md §2.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gefen.errors import StepError

__all__ = [
    "AmpControls",
    "amp_controls_present",
    "SQUARE_SAFE_MAX",
    "usable_bound",
    "usable_flags",
    "wants_native_amp",
    "read_amp_controls",
    "unscale_grads_",
    "unusable_names",
    "nonfinite_error",
    "policy_name",
]


@dataclass(frozen=True)
class AmpControls:
    """The scaler's per-step controls, validated and read on the host.

    Attributes:
        overflow: the scaler found an Inf/NaN in some gradient: skip the step, change nothing.
        grad_scale: the scale the gradients still carry (``None``: already unscaled), a 1-element fp32 tensor.
    """

    overflow: bool
    grad_scale: Tensor | None


def wants_native_amp(grads: Iterable[Tensor | None]) -> bool:
    """Value of ``_step_supports_amp_scaling``: whether any present gradient is ``torch.float16``."""
    return any(g is not None and g.dtype == torch.float16 for g in grads)


def amp_controls_present(owner: object) -> bool:
    """Whether ``GradScaler.step`` left its controls (``found_inf`` / ``grad_scale``) on ``owner`` this step."""
    return any(name in vars(owner) for name in ("found_inf", "grad_scale"))


def read_amp_controls(owner: object, kind: str) -> AmpControls | None:
    """Read and validate ``owner.found_inf`` / ``owner.grad_scale`` set by ``GradScaler.step``.

    Args:
        owner: the optimizer.
        kind: its class name, for messages.

    Returns:
        ``None`` when the attributes are absent (no scaler, or the ordinary path: costs nothing), else
        :class:`AmpControls`. Reading them is one host sync (fp16 training only).

    Raises:
        StepError: ``found_inf`` is not a 1-element real tensor; ``grad_scale`` is not ``None`` or a 1-element
            real tensor holding a finite value ``> 0``.
    """
    present = [name for name in ("found_inf", "grad_scale") if name in vars(owner)]
    if not present:
        return None
    if len(present) != 2:
        raise StepError(
            f"{kind}: only {present[0]!r} of the GradScaler controls found_inf/grad_scale is set on the optimizer; "
            "set both (torch.amp.GradScaler.step does) or neither. Nothing was changed."
        )
    found_inf, grad_scale = vars(owner)["found_inf"], vars(owner)["grad_scale"]
    if not isinstance(found_inf, Tensor) or found_inf.numel() != 1 or found_inf.is_complex():
        shape = tuple(found_inf.shape) if isinstance(found_inf, Tensor) else type(found_inf).__name__
        raise StepError(
            f"{kind}: GradScaler control found_inf must be a 1-element tensor, got {shape}; a scaler shared across "
            "optimizers or devices must reduce it first. Nothing was changed."
        )
    if grad_scale is not None:
        if not isinstance(grad_scale, Tensor) or grad_scale.numel() != 1 or grad_scale.is_complex():
            shape = tuple(grad_scale.shape) if isinstance(grad_scale, Tensor) else type(grad_scale).__name__
            raise StepError(
                f"{kind}: GradScaler control grad_scale must be None or a 1-element tensor, got {shape}. "
                "Nothing was changed."
            )
        value = float(grad_scale.detach().double().reshape(()).item())
        if not (value > 0.0 and value != float("inf")):
            raise StepError(
                f"{kind}: GradScaler control grad_scale={value} must be finite and > 0 (the scaler's scale "
                "collapsed or was corrupted). Nothing was changed."
            )
    overflow = bool(found_inf.detach().reshape(()).item() != 0)
    return AmpControls(overflow, grad_scale)


def unscale_grads_(grads: Sequence[Tensor], grad_scale: Tensor) -> None:
    """Divide every gradient by ``grad_scale`` in place, bit-for-bit like ``GradScaler.unscale_``.

    The reciprocal is ``float32(1 / float64(scale))`` (the scaler's own rounding) and each gradient is multiplied
    by it in its own dtype, one ``_foreach_mul_`` per (device, dtype).

    Args:
        grads: gradient tensors (any floating dtype, any devices).
        grad_scale: 1-element tensor, finite and ``> 0``.
    """
    inv = grad_scale.detach().double().reciprocal().float().reshape(())
    buckets: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for g in grads:
        buckets.setdefault((g.device, g.dtype), []).append(g)
    for (device, _dtype), items in buckets.items():
        torch._foreach_mul_(items, inv.to(device))


#: Largest magnitude whose square is finite in float32 (``sqrt(finfo(float32).max)``).
SQUARE_SAFE_MAX = 1.8446742e19


def usable_bound(numel: int) -> float:
    """Largest gradient magnitude the step accepts for a tensor of ``numel`` elements: ``SQUARE_SAFE_MAX /
    sqrt(numel)``, so that every sum of squares the second moments take (row, column, block or whole tensor) is
    finite in float32. A larger gradient is finite but would turn the second moment into Inf/NaN (4.3e16 for a
    million elements: far beyond any real gradient)."""
    return SQUARE_SAFE_MAX / math.sqrt(max(numel, 1))


def _usable(grad: Tensor) -> Tensor:
    """0-dim bool: finite, and within :func:`usable_bound` (NaN compares False). One fused min/max reduction: no
    gradient-sized temporary (``abs()`` would allocate one, and its page faults cost ~10x the reduction)."""
    if not grad.numel():
        return torch.ones((), dtype=torch.bool, device=grad.device)
    bound = usable_bound(grad.numel())
    low, high = torch.aminmax(grad.detach())
    # compared in float32: against a Python bound a float16 tensor compares in float16, where the bound (and so
    # every infinity) is inf <= inf
    return (high.float() <= bound) & (low.float() >= -bound)


def usable_flags(grads: Sequence[Tensor]) -> Tensor:
    """Per gradient, whether it is usable (finite and within :func:`usable_bound`), without a host read.

    On CUDA a fixed number of multi-tensor launches per dtype, whatever the number of gradients
    (:func:`usable_flags_multi_tensor`); elsewhere one fused min/max reduction per gradient (no temporary).

    Args:
        grads: gradients on one device (any dtypes and shapes; at least one).

    Returns:
        (len(grads),) bool on that device (a step can act on it on the device, see :data:`gefen.kernels.fused.APPLY`).
    """
    if grads[0].device.type == "cuda":
        return usable_flags_multi_tensor(grads)
    return torch.stack([_usable(g) for g in grads])


@functools.lru_cache(maxsize=1024)
def _usable_bound_fp32(numel: int) -> float:
    """:func:`usable_bound` rounded to fp32 (what a float32 comparison uses), cached: a model has few sizes and the
    multi-tensor check asks for every gradient's at every step."""
    return struct.unpack("f", struct.pack("f", usable_bound(numel)))[0]


def usable_flags_multi_tensor(grads: Sequence[Tensor]) -> Tensor:
    """:func:`usable_flags` by torch's multi-tensor reductions: per dtype, the largest magnitude of every gradient
    (``_foreach_norm(ord=inf)``) compared with its :func:`usable_bound` (``peak - fp32(bound) <= 0``: exact, a
    difference of two floats keeps its sign) and the sum of magnitudes (``ord=1``, in fp32 at least) required
    finite. The second
    guard makes the result independent of whether the max reduction propagates NaN (C's ``fmax`` does not): a NaN
    or Inf anywhere makes the sum NaN/Inf, while a usable gradient's sum stays below ``1.9e19·sqrt(N)``, finite.
    Same answers as the per-gradient reduction (tests/test_amp.py compares them at the bounds).

    Args:
        grads: gradients on one device (any dtypes and shapes; at least one).

    Returns:
        (len(grads),) bool on that device.
    """
    by_dtype: dict[torch.dtype, list[int]] = {}
    flags: list[Tensor] = [grads[0]] * len(grads)  # placeholders, each replaced below
    for i, g in enumerate(grads):
        if g.numel():
            by_dtype.setdefault(g.dtype, []).append(i)
        else:  # nothing to check (and no identity for the max of nothing)
            flags[i] = torch.ones((), dtype=torch.bool, device=g.device)
    for indices in by_dtype.values():
        tensors = [grads[i].detach() for i in indices]
        bounds = [_usable_bound_fp32(t.numel()) for t in tensors]
        margins = torch._foreach_sub(torch._foreach_norm(tensors, float("inf")), bounds)
        wide = torch.float64 if tensors[0].dtype == torch.float64 else torch.float32  # fp16's sum would overflow
        totals = torch._foreach_norm(tensors, 1, dtype=wide)
        ok = (torch.stack(margins) <= 0) & torch.stack(totals).isfinite()
        for j, i in enumerate(indices):
            flags[i] = ok[j]
    return flags[0].reshape(1) if len(flags) == 1 else torch.stack(flags)  # in the gradients' order


def unusable_names(named_grads: Sequence[tuple[str, Tensor]]) -> list[str]:
    """Names, in order, of the gradients holding a NaN, an Inf, or a value beyond :func:`usable_bound` (whose sums
    of squares would overflow float32); one fused min/max reduction per gradient and one host read for all.

    Args:
        named_grads: ``(name, gradient)`` pairs (any devices, dtypes and shapes).
    """
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, g) in enumerate(named_grads):
        by_device.setdefault(g.device, []).append(i)
    bad = []
    for indices in by_device.values():
        ok = usable_flags([named_grads[i][1] for i in indices]).cpu()
        bad += [i for i, flag in zip(indices, ok.tolist()) if not flag]
    return [named_grads[i][0] for i in sorted(bad)]


def policy_name(deterministic: bool) -> str:
    """How a message names the policy that refuses every unusable gradient."""
    return "deterministic=True" if deterministic else "nonfinite='raise'"


def nonfinite_error(kind: str, name: str, policy: str | None) -> StepError:
    """The error for an unusable gradient (see :func:`unusable_names`).

    Args:
        kind: the optimizer's class name.
        name: the parameter's name.
        policy: :func:`policy_name` when a policy refuses every such step;
            ``None`` for a parameter's first gradient (always refused: its period and the codebook come from it).
    """
    what = (
        "has NaN/Inf values, or values so large (beyond 1.8e19/sqrt(numel)) that its sums of squares overflow float32"
    )
    if policy is not None:
        return StepError(
            f"{kind}: the gradient of {name} {what} and {policy} refuses such steps; nothing was changed. Skip the "
            "step (torch.amp.GradScaler does this for overflows) or find the source."
        )
    return StepError(
        f"{kind}: the first gradient of {name} {what}; its period search and the codebook need finite gradients "
        "(use torch.amp.GradScaler, which skips such steps, or skip the step yourself). Nothing was changed."
    )
