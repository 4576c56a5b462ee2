"""Step backends of the Gefen optimizers, behind one interface (:mod:`gefen.kernels.backends`).

* ``"eager"`` (:mod:`gefen.kernels.eager`): torch operations, the reference every other backend follows.
* ``"native"`` (:mod:`gefen.kernels.native_step`, library :mod:`gefen.kernels.native`): C with SIMD and run-time CPU
  dispatch, torch's OpenMP threads, no compile time; the CPU default.
* ``"compiled"`` (:mod:`gefen.kernels.compiled`): ``torch.compile``\\ d graphs per parameter signature (inductor C++
  on CPU, Triton on CUDA); on CUDA where the Triton step cannot run (unless ``GEFEN_FUSED=0``).
* ``"triton"`` (:mod:`gefen.kernels.triton_step`): hand-written multi-tensor Triton kernels for CUDA, a device-side
  plan so that a steady step's host work does not grow with the number of parameters; the CUDA default once its
  self-check passed on the device (:mod:`gefen.kernels.triton_check`).

Every backend gives codes and magnitudes bit-identical to the reference; second moments (and through them the
parameters) may differ by the summation order of their sums, a few ulps (the tests state the bound). Per-step
constants come from one record, :class:`gefen.kernels.scalars.StepScalars`. The first step's operations (period
scores, histogram, codebook fit) are chosen in :mod:`gefen.kernels.first_step`.

``backend="auto"`` (the default) takes, per parameter, the first backend of its device's
:data:`~gefen.kernels.backends.AUTO_ORDER` that is available and supports it, else the eager one. The old ``fused``
flag is an alias: ``fused=True`` is ``backend="compiled"``, ``fused=False`` is ``backend="eager"``.
:func:`native_status` says whether (and at which CPU level) the native library runs here.
"""

from __future__ import annotations

from gefen.kernels.backends import AUTO_ORDER, BACKENDS, REGISTRY, group_backend, resolve_backend_option
from gefen.kernels.native import native_status

__all__ = ["BACKENDS", "AUTO_ORDER", "REGISTRY", "resolve_backend_option", "group_backend", "native_status"]
