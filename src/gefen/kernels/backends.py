"""The step-backend interface, its registry and the one function that chooses a backend for a parameter.

A *step backend* applies one optimizer step to a batch of parameters: the Gefen update of algorithm.md §6.2
(block second moment) and §6.4 (factored), or GefenMuon's quantized momentum (§7.1 step 2, writing ``m̂`` for the
orthogonalisation that follows). Backends are siblings behind one signature, as torch.optim's
``_single_tensor_`` / ``_foreach_`` / ``_fused_`` functions are:

* :meth:`StepBackend.supports` — can it step this parameter here (empty string) or why not;
* :meth:`StepBackend.prepare` — every check and allocation (a compilation, a device plan) before any write;
  raises :class:`gefen.errors.StepError` with nothing changed, or marks jobs it cannot run for the eager backend;
* :meth:`StepBackend.run` — the step itself, the state, the parameters and the step counters written in place.

Every backend follows the eager reference's rounding (:mod:`gefen.kernels.eager`): codes and magnitudes are
bit-identical, second moments (and through them the parameters) may differ by the summation order of their sums.

The registry (:data:`REGISTRY`, :data:`AUTO_ORDER`) is the only place that lists backends: a new backend is its own
module plus one entry here. ``backend="auto"`` takes, for each parameter, the first backend of its device's
:data:`AUTO_ORDER` that supports it; the eager backend supports everything.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from gefen.errors import ConfigError
from gefen.kernels.scalars import StepScalars
from gefen.math.lookup import NearestCodeTable
from gefen.state import FIRST_MOMENT_CODES, SECOND_MOMENT, SECOND_MOMENT_ROW

__all__ = [
    "BACKENDS",
    "REGISTRY",
    "AUTO_ORDER",
    "StepJob",
    "StepContext",
    "StepOutcome",
    "StepBackend",
    "Backends",
    "resolve_backend_option",
    "group_backend",
    "FUSED_ENV",
    "fused_by_default",
    "dtype_reason",
]

#: Backend modules by name: ``"module:Class"`` (imported on first use, so a backend's own dependencies, e.g.
#: Triton, load only where it runs).
REGISTRY: dict[str, str] = {
    "eager": "gefen.kernels.eager:EagerBackend",
    "native": "gefen.kernels.native_step:NativeBackend",
    "compiled": "gefen.kernels.compiled:CompiledBackend",
    "triton": "gefen.kernels.triton_step:TritonBackend",
}
#: What ``backend="auto"`` tries, per device type, in order (the eager backend takes the rest).
AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "cpu": ("native",),
    "cuda": ("triton", "compiled"),  # the compiled backend where Triton is missing or failed its self-check
}
#: The accepted ``backend`` option values.
BACKENDS = ("auto", *REGISTRY)
#: Environment variable that sets whether ``backend="auto"`` (``fused=None``) may choose the compiled backend:
#: ``"1"`` (default) where it works, ``"0"`` never (e.g. short test runs where compile time would dominate).
#: An explicit ``backend=``/``fused=`` ignores it.
FUSED_ENV = "GEFEN_FUSED"


def fused_by_default() -> bool:
    """Whether ``backend="auto"`` may choose the compiled backend: the :data:`FUSED_ENV` setting (``"1"`` unless
    set to ``"0"``).

    Raises:
        ConfigError: the variable holds anything but ``"0"`` or ``"1"``.
    """
    value = os.environ.get(FUSED_ENV, "1").strip()
    if value not in ("0", "1"):
        raise ConfigError(f"environment variable {FUSED_ENV}={value!r} must be '0' (eager) or '1' (compiled).")
    return value == "1"


@dataclass
class StepJob:
    """One parameter's update in one step, as every backend takes it.

    Attributes:
        name: the parameter's name (for messages).
        param: the parameter (its state's key; a DTensor when sharded).
        target: the tensor the update writes: the parameter, or this rank's rows of a sharded one.
        grad: the gradient, a plain tensor of ``target``'s shape (validated, unscaled).
        state: the parameter's state as plain local tensors (``gefen.state`` keys).
        group: its param group.
        scalars: the group's per-step record (:class:`gefen.kernels.scalars.StepScalars`).
        shard: this rank's rows of a row-sharded parameter (:class:`gefen.sharding.RowShard`), else ``None``.
        out: GefenMuon's momentum only: receives ``m̂`` (fp32, the codes' (B, P) shape), set by the backend.
        prepared: what the backend's :meth:`StepBackend.prepare` left for its :meth:`StepBackend.run` (e.g. a
            compiled kernel's signature); private to that backend, and gone with the job.
    """

    name: str
    param: Tensor
    target: Tensor
    grad: Tensor
    state: dict[str, Tensor]
    group: Mapping[str, Any]
    scalars: StepScalars
    shard: Any = None
    out: Tensor | None = None
    prepared: Any = None

    @property
    def kind(self) -> str:
        """``"factored"``, ``"block"`` or ``"momentum"`` (GefenMuon: first moment only)."""
        if SECOND_MOMENT_ROW in self.state:
            return "factored"
        return "block" if SECOND_MOMENT in self.state else "momentum"

    @property
    def period(self) -> int:
        return int(self.state[FIRST_MOMENT_CODES].shape[1])


@dataclass
class StepContext:
    """What a backend needs from the optimizer besides its jobs.

    Attributes:
        kind: the optimizer's class name (for messages).
        table: the nearest-code table of the step's codebook on a device (built once per device and codebook).
        deterministic: the optimizer's ``deterministic`` flag.
        capturable: the optimizer's ``capturable`` flag: the step counters are device tensors in the state, which a
            capturing backend (``captures = True``) advances itself; no host read, no host-side counter.
        settle: settles every step still pending (:meth:`gefen.nonfinite.PendingCheck.outcome`), so that the
            optimizer's host step counters are current: a backend that keeps its own device counters
            (``device_counters = True``, the Triton one) calls it before it reads them for a new plan.
    """

    kind: str
    table: Callable[[torch.device], NearestCodeTable]
    deterministic: bool = False
    settle: Callable[[], object] = lambda: None
    capturable: bool = False

    @staticmethod
    def strict(job: StepJob, name: str) -> bool:
        """Whether ``job``'s group asked for backend ``name`` explicitly (``backend=...`` or ``fused=True``): a
        backend that cannot prepare it then refuses the step instead of leaving it to the eager backend."""
        return group_backend(job.group) == name


@dataclass
class StepOutcome:
    """What :meth:`StepBackend.run` did.

    Attributes:
        unusable: the names of the parameters whose gradients failed the ``nonfinite`` check the run was asked to
            make on the host (``check="host"``): when not empty, nothing at all was changed.
        left: jobs the backend could not run after all (a compiled kernel that failed inside the step): the
            caller runs them on the eager backend, in this step.
        applied: under ``capturable=True`` with ``check="device"``: a 0-dim int32 device tensor, 1 when the step was
            applied (the caller counts it on the device), instead of ``pending``.
        pending: a step decided on the device (``check="device"``): a :class:`gefen.nonfinite.PendingCheck`
            to settle when the host next looks (its counters advanced then, or the skip counted).
    """

    unusable: list[str] = field(default_factory=list)
    left: list[StepJob] = field(default_factory=list)
    pending: Any = None
    applied: Tensor | None = None


class StepBackend(Protocol):
    """A step backend (see the module docstring). One instance per optimizer: it may cache per-process work
    (compiled kernels, device plans), never state that a checkpoint would need."""

    name: str
    #: It can apply the ``nonfinite`` check itself: ``"host"`` (inside its own pass, refusing before any write),
    #: ``"device"`` (decided on the device without a host read), or ``""`` (not at all).
    checks: str
    #: Optional (default ``False``): its steps read their step counters from device copies it keeps, not from the
    #: optimizer's host counters, so a step may start while an earlier device decision is still unsettled.
    device_counters: bool
    #: Optional (default ``False``): it can run under ``capturable=True`` (no host read, the state's device
    #: counters advanced by its own kernels, a CUDA graph can capture it).
    captures: bool

    # Optional: ``forget_state() -> None``, called when the optimizer's state is replaced (a load), to drop what the
    # backend derived from the old state (see :meth:`Backends.forget_state`).

    def available(self) -> str:
        """Why this backend cannot run in this process at all (a missing library or package; empty: it can)."""
        ...

    def supports(self, param: Tensor, grad_dtype: torch.dtype, sharded: bool) -> str:
        """Why this backend cannot step ``param`` here (an empty string: it can); includes :meth:`available`'s
        reason."""
        ...

    def prepare(self, jobs: list[StepJob], context: StepContext) -> list[StepJob]:
        """Check and allocate everything :meth:`run` needs; no write. Returns the jobs it cannot run (the caller
        gives them to the eager backend).

        Raises:
            StepError: a job the user required this backend for cannot run; nothing was changed.
        """
        ...

    def run(self, jobs: list[StepJob], context: StepContext, check: str = "") -> StepOutcome:
        """Apply the step to ``jobs`` (prepared), advancing each one's step counter once it is applied.

        Args:
            check: ``""`` (no check), ``"host"`` or ``"device"`` (see :attr:`checks` and :class:`StepOutcome`).
        """
        ...


def dtype_reason(param: Tensor, grad_dtype: torch.dtype, supported: Sequence[torch.dtype], backend: str) -> str:
    """Why a backend whose kernels take ``supported`` dtypes cannot step ``param`` with a ``grad_dtype`` gradient
    (float64 gradients are cast to fp32 first); empty when it can."""
    if param.dtype not in supported:
        names = "/".join(str(d).removeprefix("torch.") for d in supported)
        return f"the parameter is {param.dtype} (the {backend} backend supports {names})"
    if grad_dtype not in supported and grad_dtype != torch.float64:
        return f"the gradient is {grad_dtype}"
    return ""


def resolve_backend_option(kind: str, backend: Any, fused: Any, error: type[Exception]) -> str:
    """The ``backend`` a constructor call asks for, with the deprecated ``fused`` alias folded in.

    Args:
        kind: the optimizer's class name (for messages).
        backend: the ``backend`` argument. fused: the ``fused`` argument (``None``, ``True`` or ``False``).
        error: exception class for invalid values (``ConfigError``).

    Returns:
        One of :data:`BACKENDS`.

    Raises:
        error: an unknown backend, or ``fused`` contradicting an explicit ``backend``.
    """
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise error(f"{kind}: backend={backend!r} is not one of {', '.join(map(repr, BACKENDS))}.")
    if fused is None:
        return backend
    alias = "compiled" if fused else "eager"
    if backend not in ("auto", alias):
        raise error(
            f"{kind}: fused={fused!r} means backend={alias!r}, which contradicts backend={backend!r}; "
            "pass only backend= (fused is a deprecated alias)."
        )
    return alias


def group_backend(group: Mapping[str, Any]) -> str:
    """The backend a param group asks for: its ``backend`` key, else its legacy ``fused`` flag, else ``"auto"``."""
    backend = group.get("backend")
    if backend not in (None, "auto"):
        return str(backend)
    fused = group.get("fused")
    if fused is True:
        return "compiled"
    if fused is False:
        return "eager"
    return "auto"


class Backends:
    """One optimizer's backend instances (created on first use) and the choice of a backend per parameter."""

    def __init__(self) -> None:
        self._instances: dict[str, StepBackend] = {}

    def get(self, name: str) -> StepBackend:
        """The instance of backend ``name`` (imported and created on first use).

        Raises:
            KeyError: an unknown name.
        """
        backend = self._instances.get(name)
        if backend is None:
            module, cls = REGISTRY[name].split(":")
            backend = self._instances[name] = getattr(importlib.import_module(module), cls)()
        return backend

    def loaded(self, name: str) -> StepBackend | None:
        """The instance of backend ``name`` if it was created, else ``None`` (creates nothing)."""
        return self._instances.get(name)

    def forget_state(self) -> None:
        """The optimizer's state was replaced (a load): every backend drops what it derived from the old one (the
        Triton backend's plans and their device step counters), through its optional ``forget_state()``."""
        for backend in self._instances.values():
            forget = getattr(backend, "forget_state", None)
            if forget is not None:
                forget()

    def choose(self, requested: str, param: Tensor, grad_dtype: torch.dtype, sharded: bool) -> tuple[str, str]:
        """The backend that steps ``param``, and why it is not the one asked for.

        Args:
            requested: the group's backend (:func:`group_backend`): ``"auto"`` or a :data:`REGISTRY` name.

        Returns:
            ``(name, reason)``. For ``"auto"``: the first backend of :data:`AUTO_ORDER` for the device that is
            available and supports it, else ``"eager"`` with the reason the first unavailable one gave (a missing
            library: the caller warns once; empty where the parameter simply runs eagerly, e.g. float64). For an
            explicit name: that name, and the reason it cannot run (empty when it can); the caller refuses.
        """
        if requested != "auto":
            return requested, self.get(requested).supports(param, grad_dtype, sharded)
        missing, compiled = "", fused_by_default()  # a bad GEFEN_FUSED is refused whatever the device
        for name in AUTO_ORDER.get(param.device.type, ()):
            if name == "compiled" and not compiled:
                continue
            backend = self.get(name)
            unavailable = backend.available()
            if unavailable:
                missing = missing or f"the {name} backend is unavailable: {unavailable}"
                continue
            if not backend.supports(param, grad_dtype, sharded):
                return name, ""
        return "eager", missing

    def batches(self, chosen: Sequence[tuple[StepJob, str]]) -> list[tuple[StepBackend, list[StepJob]]]:
        """Group jobs by their chosen backend, in the order each backend first appears (stable)."""
        order: dict[str, list[StepJob]] = {}
        for job, name in chosen:
            order.setdefault(name, []).append(job)
        return [(self.get(name), jobs) for name, jobs in order.items()]
