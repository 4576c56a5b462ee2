"""Orchestration shared by every Gefen optimizer: construction and param-group validation, the closure,
gradient preflight, checkpoint save/load plumbing and byte accounting.

Subclasses supply the math (``_update``), the kind of second moment per parameter and their class name; the
``torch.optim`` contract (param groups, hooks, ``zero_grad``, LR schedulers, ``state_dict`` layout) is kept
exactly as torch defines it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from gefen._warnings import warn_user
from gefen.agreement import agree
from gefen.amp import (
    amp_controls_present,
    nonfinite_error,
    policy_name,
    read_amp_controls,
    unscale_grads_,
    unusable_names,
    wants_native_amp,
)
from gefen.checkpoint import LIVE_GROUP_CARRIERS, StagedLoad, attach_metadata, build_metadata, stage_load
from gefen.errors import ConfigError, StepError
from gefen.hyperparams import check_flags, check_group, refuse_torch_only_options
from gefen.kernels.backends import Backends, fused_by_default, group_backend, resolve_backend_option
from gefen.nonfinite import PendingCheck, resolve_nonfinite, skip_message
from gefen.optim._device_decisions import DeviceDecisions
from gefen.optim._dropin import publish_group
from gefen.optim._param_input import given_names, param_label, read_params, refuse_duplicates
from gefen.sharding import RowShard, is_dtensor, local, local_state, mesh_key, row_shard
from gefen.state import (
    STEP,
    ParamState,
    SecondMomentKind,
    layout_name,
    placeholder_state,
    state_bytes,
    state_mismatch,
    tensor_bytes,
)

__all__ = ["GefenOptimizer", "StepSkip", "WorkItem", "iter_named_params"]


def _live_metadata(optimizer: GefenOptimizer) -> dict[str, Any]:
    """The metadata entry ``state_dict()`` writes for ``optimizer`` now."""
    distinct = {id(p): p for g in optimizer.param_groups for p in g["params"]}  # a repeated group counts once
    stateful = sum(1 for p in distinct.values() if STEP in optimizer.state.get(p, ()))
    meta = build_metadata(
        optimizer.kind,
        optimizer._codebook,
        optimizer.global_step,
        optimizer.deterministic,
        optimizer.skipped_steps,
        stateful,
    )
    meta["device_anchor"] = torch.zeros(1, dtype=torch.uint8, device=optimizer._codebook_device())
    if meta["codebook"] is None:  # DCP's full-state merge keeps a live None over the checkpoint's codebook
        del meta["codebook"]
    return meta


def _add_metadata(optimizer: GefenOptimizer, state_dict: dict[str, Any]) -> None:
    """State-dict post-hook: add the checkpoint metadata (module-level so optimizers stay picklable)."""
    meta = _live_metadata(optimizer)
    _add_placeholders(optimizer, state_dict)
    attach_metadata(state_dict, meta)


def _add_placeholders(optimizer: GefenOptimizer, state_dict: dict[str, Any]) -> None:
    """Give every parameter without state zero counters in the optimizer's state dict.

    ``torch.distributed.checkpoint``'s full-state ``set_optimizer_state_dict`` merges the checkpoint into the live
    optimizer's own state dict and can only merge 0-dim entries the live dict already has (with or without
    sharding, with or without ``broadcast_from_rank0``); a fresh Gefen has no state yet (it is created by the first
    real gradient), so these zero counters stand in for it. A loader reads an entry of zero counters as "no
    state" (case 003).
    """
    index = 0
    seen: set[int] = set()  # a parameter listed again keeps its first index, as torch numbers it
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen and STEP not in optimizer.state.get(p, ()):  # also an empty entry a mere read made
                state_dict["state"][index] = placeholder_state(optimizer._second_moment_kind(p, group))
            seen.add(id(p))
            index += 1


def iter_named_params(param_groups: list[dict[str, Any]]) -> Iterator[tuple[int, int, Tensor, str]]:
    """``(group index, index in group, parameter, name)`` over param groups; names come from ``param_names``
    where present, else ``param_groups[g][i]``."""
    for g, group in enumerate(param_groups):
        names = group.get("param_names")
        for i, p in enumerate(group["params"]):
            yield g, i, p, names[i] if names is not None else f"param_groups[{g}][{i}]"


@dataclass(frozen=True)
class StepSkip:
    """Why a step changes nothing.

    Attributes:
        nonfinite: ``True``: a gradient holds NaN/Inf under ``nonfinite="skip"`` (counted in ``skipped_steps``);
            ``False``: GradScaler found an overflow (its own skip, not counted).
        names: the parameters whose gradients are unusable (this rank's; empty for an overflow).
    """

    nonfinite: bool
    names: tuple[str, ...] = ()


@dataclass
class WorkItem:
    """One parameter to update in this step.

    Attributes:
        param: the parameter tensor (the key of its state; a DTensor for a sharded parameter).
        grad: its gradient as a plain tensor, of :attr:`target`'s shape (validated): this rank's rows of a
            sharded parameter's gradient.
        name: the parameter's name (from ``(name, tensor)`` pairs) or ``param_groups[g][i]``.
        shard: the rows this rank holds of a sharded (DTensor) parameter, ``None`` for a plain tensor.
    """

    param: Tensor
    grad: Tensor
    name: str
    shard: RowShard | None = None

    @property
    def target(self) -> Tensor:
        """The tensor the update writes: the parameter, or this rank's rows of a sharded one (a view)."""
        return local(self.param)


class GefenOptimizer(DeviceDecisions, torch.optim.Optimizer):
    """Base class of the Gefen optimizers (not instantiated directly).

    Subclasses implement :meth:`_step_group` and :meth:`_second_moment_kind` and may extend
    :meth:`_check_group`. Each public ``__init__`` checks only its own options, builds its ``defaults`` and calls
    :meth:`_init_optimizer`, the one construction path: ``GefenMuon`` subclasses ``Gefen`` with another
    signature, so it cannot run ``Gefen.__init__``, and everything the two share is set up there instead.
    """

    #: Name written into checkpoints and messages; subclasses override.
    kind: str = "GefenOptimizer"
    #: Whether ``capturable=True`` may take ``nonfinite="skip"``, decided on the device (Gefen on Triton).
    _skips_on_device: bool = False
    #: What a message tells a user who passed an ``nn.Module`` as ``params`` to pass instead.
    _module_hint: str = "model.named_parameters() (names then appear in messages and checkpoints)"

    def _init_optimizer(
        self,
        params: Any,
        defaults: dict[str, Any],
        *,
        flags: Mapping[str, object],
        backend: str,
        fused: bool | None,
        deterministic: bool,
        capturable: bool,
        nonfinite: str | None,
        torch_options: Mapping[str, Any],
    ) -> None:
        """Validate the options every Gefen optimizer shares, then build the optimizer (``torch.optim``'s
        constructor, the codebook slot, counters, per-process caches, the checkpoint hook).

        Args:
            params: the constructor's ``params``.
            defaults: the subclass's hyperparameters (``backend`` and ``fused`` are appended here).
            flags: the subclass's own boolean options, type-checked here with ``fused``.
            backend, fused, deterministic, capturable, nonfinite: the constructor's arguments.
            torch_options: the constructor's remaining keyword arguments (``torch.optim`` options).

        Raises:
            TypeError, ConfigError: an unknown or unsupported keyword argument, a flag of another type, an invalid
                ``backend``/``fused``/``GEFEN_FUSED``, an option refused by :meth:`_check_defaults`, a policy
                combination or hyperparameter that cannot be honoured, bad ``params`` (see :class:`gefen.Gefen`).
        """
        refuse_torch_only_options(self.kind, torch_options)
        check_flags(self.kind, {**flags, "fused": fused}, optional=("fused",))
        backend = resolve_backend_option(self.kind, backend, fused, ConfigError)
        if fused is None:
            fused_by_default()  # a bad GEFEN_FUSED is refused at construction, not at the first step
        defaults = {**defaults, "backend": backend, "fused": fused}
        self._check_defaults(defaults)
        check_flags(self.kind, {"deterministic": deterministic, "capturable": capturable})
        self.nonfinite = resolve_nonfinite(self.kind, nonfinite, deterministic, capturable, self._skips_on_device)
        self.deterministic = deterministic
        self.capturable = capturable
        check_group(defaults, self.kind)
        groups = read_params(self.kind, params, self._module_hint)
        self._codebook: Tensor | None = None
        self._tables: dict[Any, Any] = {}  # per-device caches derived from the codebook
        self._global_step = 0
        self._skipped_steps = 0
        self._init_runtime()
        callers = [g if isinstance(g, dict) else None for g in groups]  # published once every group is accepted
        super().__init__([dict(g) if isinstance(g, dict) else g for g in groups], defaults)  # torch.optim's
        for index, caller in enumerate(callers if len(callers) == len(self.param_groups) else []):
            if caller is not None:
                publish_group(self.param_groups, index, caller)
        # capturable=True: the global step is a device counter (graph replays run no Python)
        self._global_step_t: Tensor | None = (
            torch.zeros((), dtype=torch.int64, device=self._codebook_device()) if capturable else None
        )
        # capturable=True under nonfinite="skip": steps skipped on the device since the host last looked
        self._skipped_t: Tensor | None = None if self._global_step_t is None else torch.zeros_like(self._global_step_t)
        self.register_state_dict_post_hook(_add_metadata, prepend=True)

    def _check_defaults(self, defaults: Mapping[str, Any]) -> None:
        """Subclass hook: validate the subclass's own options in the constructor's ``defaults`` (raise
        ConfigError)."""

    def __getstate__(self) -> dict[str, Any]:
        """Pickle/deepcopy support: torch's fields plus the codebook and the global step."""
        self._settle_pending_check()
        state = super().__getstate__()
        for key in (
            "_codebook",
            "_global_step",
            "_global_step_t",
            "_skipped_t",
            "_skipped_steps",
            "deterministic",
            "capturable",
            "nonfinite",
        ):
            state[key] = getattr(self, key)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_codebook", None)
        self.__dict__.setdefault("_global_step", 0)
        self.__dict__.setdefault("deterministic", False)
        self.__dict__.setdefault("capturable", False)
        self.__dict__.setdefault("nonfinite", "propagate")
        self.__dict__.setdefault("_skipped_steps", 0)
        self.__dict__.setdefault("_global_step_t", None)
        self.__dict__.setdefault("_skipped_t", None)
        for group in self.param_groups:
            group.update(LIVE_GROUP_CARRIERS)
        self._tables = {}
        self._init_runtime()
        if _add_metadata not in self._optimizer_state_dict_post_hooks.values():
            self.register_state_dict_post_hook(_add_metadata, prepend=True)

    def _init_runtime(self) -> None:
        """Per-process caches that are never pickled or checkpointed (compiled kernels, pending codebook)."""
        self._backends = Backends()  # this optimizer's backend instances (compiled kernels, device plans)
        self._shards: dict[int, RowShard | None] = {}
        self._pending_codebook: Tensor | None = None
        self._warned_native = False
        self._pending_checks: list[PendingCheck] = []  # steps decided on the device, not yet settled, oldest first
        self._stepped_by: dict[int, str] = {}  # id(param) -> the backend that ran its latest step (state_report)

    @property
    def compile_time_s(self) -> float:
        """Seconds spent compiling fused step kernels in this process (``0.0`` on the eager path)."""
        compiled = self._backends.loaded("compiled")
        return compiled.kernels.compile_time_s if compiled is not None else 0.0

    @property
    def _kernels(self) -> Any:
        """The compiled backend's kernel cache (:class:`gefen.kernels.compiled.StepKernels`)."""
        return self._backends.get("compiled").kernels

    # ------------------------------------------------------------------ construction / param groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (``torch.optim`` semantics), validating it fully before anything is registered.

        Raises:
            TypeError: ``param_group`` is not a dict, or holds something that is not a tensor.
            ConfigError: invalid hyperparameters (or an option the subclass refuses in :meth:`_check_group`,
                e.g. Gefen's ``maximize=True``), complex or duplicate parameters, or a parameter already in
                another group.

        On success the caller's dict is the new group (``param_groups[-1] is param_group``), filled in as torch
        fills it; on a refusal it is left as it was.
        """
        if not isinstance(param_group, dict):
            raise TypeError(f"{self.kind} param_group must be a dict, got {type(param_group).__name__}.")
        if "params" not in param_group:
            raise ConfigError(f"{self.kind} param group {sorted(param_group)} has no 'params' entry.")
        group = dict(param_group)
        where = f"{self.kind} param_groups[{len(self.param_groups)}]"
        check_group({**self.defaults, **group}, where)
        raw = group["params"]
        items = [raw] if isinstance(raw, Tensor) else raw
        if isinstance(items, set):
            raise TypeError(f"{where}['params'] is a set, whose order changes between runs; pass a list.")
        items = list(items)  # an empty group is accepted, as torch accepts it (e.g. a "no decay" group of none)
        names = given_names(items, group.get("param_names"))
        labels = [param_label(where, i, name) for i, name in enumerate(names)]
        tensors = []
        for label, item in zip(labels, items):
            tensor = item[1] if isinstance(item, tuple) and len(item) == 2 else item
            if isinstance(item, tuple) and (len(item) != 2 or not isinstance(item[0], str)):
                raise TypeError(f"{label} must be a tensor or a (name, tensor) pair.")
            if isinstance(tensor, nn.Module):
                raise TypeError(f"{label} is a {type(tensor).__name__} (an nn.Module); pass {self._module_hint}.")
            if not isinstance(tensor, Tensor):
                raise TypeError(f"{label} is a {type(tensor).__name__}, not a torch.Tensor.")
            if tensor.is_complex() or not tensor.is_floating_point():
                raise ConfigError(
                    f"{label} has dtype {tensor.dtype}; {self.kind} optimizes real floating "
                    "tensors only (for complex parameters optimize torch.view_as_real(p))."
                )
            tensors.append(tensor)
        named = "param_names" in group or any(name is not None for name in names)
        refuse_duplicates(self.kind, where, labels, tensors, self.param_groups, named)
        self._check_group_tensors({**self.defaults, **group}, tensors, where, labels)
        self._check_sharding({**self.defaults, **group}, tensors, labels)
        self._check_group({**self.defaults, **group, "params": tensors}, len(self.param_groups))
        group["params"] = items
        super().add_param_group(group)
        group.update(LIVE_GROUP_CARRIERS)  # never a saved or user value (see gefen.checkpoint)
        publish_group(self.param_groups, -1, param_group)  # the caller's dict is the group, as in torch

    def _check_sharding(self, group: Mapping[str, Any], tensors: list[Tensor], labels: list[str]) -> None:
        """Sharded (DTensor) parameters: FSDP2's layout, one mesh for the whole optimizer, no plain tensors mixed
        in, and no policy that cannot run sharded (see :mod:`gefen.sharding`).

        Raises:
            ConfigError: naming the parameter and the fix.
        """
        existing = [p for g in self.param_groups for p in g["params"]]
        sharded_before = any(is_dtensor(p) for p in existing)
        first = self._first_shard(existing)
        for i, tensor in enumerate(tensors):
            shard = row_shard(tensor, labels[i])
            if existing and (shard is not None) != sharded_before:
                raise ConfigError(
                    f"{labels[i]} is {'a DTensor' if shard else 'a plain tensor'} but this "
                    f"{self.kind} already holds {'DTensors' if sharded_before else 'plain tensors'}: one optimizer "
                    "steps either sharded (FSDP2) parameters or plain ones. Shard the whole model with fully_shard, "
                    "or use one optimizer per kind."
                )
            existing.append(tensor)
            sharded_before = shard is not None
            if shard is None:
                continue
            first = first or shard
            if mesh_key(first.mesh) != mesh_key(shard.mesh):
                raise ConfigError(
                    f"{labels[i]} is sharded on another DeviceMesh than this {self.kind}'s other "
                    "parameters; all sharded parameters of one optimizer must share one mesh."
                )
            if self.capturable:
                raise ConfigError(
                    f"{self.kind}(capturable=True) does not step sharded (DTensor) parameters: their first step "
                    "and Muon's gathers run collectives on the host. Use capturable=False with FSDP2."
                )
            if group_backend(group) == "compiled":
                raise ConfigError(
                    f"{labels[i]} is a DTensor; fused=True covers plain tensors only (backend='compiled'; "
                    "sharded parameters run natively on the CPU or eagerly). Pass backend='auto' or 'eager'."
                )

    @staticmethod
    def _first_shard(params: list[Tensor]) -> RowShard | None:
        for p in params:
            if is_dtensor(p):
                return row_shard(p, "parameter")
        return None

    def _shard_of(self, param: Tensor) -> RowShard | None:
        """The cached :class:`~gefen.sharding.RowShard` of a parameter (``None`` for a plain tensor)."""
        if not is_dtensor(param):
            return None
        shard = self._shards.get(id(param))
        if shard is None:
            shard = row_shard(param, "parameter")
            self._shards[id(param)] = shard
        return shard

    @property
    def sharded(self) -> bool:
        """Whether this optimizer steps sharded (FSDP2 / DTensor) parameters."""
        return self._any_shard() is not None

    def _any_shard(self) -> RowShard | None:
        for group in self.param_groups:
            for p in group["params"]:
                return self._shard_of(p)
        return None

    def _identity(self) -> list[tuple[str, tuple[int, ...], str]]:
        """Ordered ``(name, global shape, dtype)`` of every parameter: what every rank must agree on."""
        return [(name, tuple(p.shape), str(p.dtype)) for _g, _i, p, name in self._iter_params()]

    # ------------------------------------------------------------------ step plumbing
    def _iter_params(self) -> Iterator[tuple[int, int, Tensor, str]]:
        return iter_named_params(self.param_groups)

    def _prepare(self) -> list[list[WorkItem]]:
        """Validate every group and gradient; returns the work per group. Writes nothing.

        Raises:
            ConfigError: a group hyperparameter became invalid (e.g. set by hand or by a scheduler); under
                ``capturable=True`` a tensor ``lr`` on another device than the group's parameters.
            StepError: a gradient is sparse, non-strided, complex or integer, of another shape or device.
        """
        plan: list[list[WorkItem]] = [[] for _ in self.param_groups]
        for g, group in enumerate(self.param_groups):
            check_group(group, f"{self.kind} param_groups[{g}]", host_values=not self.capturable)
            self._check_group(group, g)
            lr = group["lr"]
            if self.capturable and isinstance(lr, Tensor) and group["params"]:
                device = group["params"][0].device
                if lr.device != device and not (lr.device.type == "cpu" and device.type == "cpu"):
                    raise ConfigError(
                        f"{self.kind}(capturable=True) param_groups[{g}]['lr'] is on {lr.device}, the parameters on "
                        f"{device}: a captured step reads it there without a copy; create it with "
                        f"torch.tensor(lr, device={str(device)!r})."
                    )
        for g, _i, p, name in self._iter_params():
            grad = p.grad
            if grad is None or p.numel() == 0:
                continue
            param, shard = p, self._shard_of(p)
            if shard is not None:
                if not is_dtensor(grad) or tuple(grad.placements) != tuple(p.placements):
                    raise StepError(
                        f"{self.kind}: gradient of {name} is not a DTensor with the parameter's placements "
                        f"{tuple(p.placements)}; FSDP2 produces sharded gradients for sharded parameters."
                    )
                grad, p = grad.to_local(), p.to_local()
            # one attribute read per rule on the common path (a sparse or complex gradient fails the first two)
            if grad.layout != torch.strided:
                raise StepError(
                    f"{self.kind}: gradient of {name} has layout {grad.layout}; {self.kind} needs dense (strided) "
                    "gradients."
                )
            if not grad.is_floating_point():
                raise StepError(
                    f"{self.kind}: gradient of {name} has dtype {grad.dtype}; a real floating gradient is required."
                )
            if grad.shape != p.shape:
                raise StepError(
                    f"{self.kind}: gradient of {name} has shape {tuple(grad.shape)}, the parameter {tuple(p.shape)}."
                )
            device = p.device
            if grad.device != device:
                raise StepError(
                    f"{self.kind}: gradient of {name} is on {grad.device}, the parameter on {device}; move them "
                    "together."
                )
            # the global shapes (a sharded state's DTensors report theirs): rows and blocks alike (gefen.sharding)
            problem = state_mismatch(self.state.get(param, {}), tuple(param.shape), device)
            if problem is not None:
                raise StepError(
                    f"{self.kind}: the state of {name} no longer fits the parameter ({problem}); nothing was "
                    "changed. The parameter was resized or moved after its state was created (layer expansion, "
                    "model surgery, .to() after building the optimizer): rebuild the optimizer, or drop that "
                    "parameter's state (del opt.state[param]) so it starts afresh."
                )
            plan[g].append(WorkItem(param, grad, name, shard))
        return plan

    def _preflight(self, closure: Callable[[], Any] | None) -> tuple[Any, list[list[WorkItem]], StepSkip | None, bool]:
        """Everything a step checks before it may change anything: the closure, the groups and gradients, the
        GradScaler protocol (unscaling the gradients unless it found an overflow) and the NaN/Inf policy.

        A sharded optimizer then agrees with every rank (:func:`gefen.agreement.agree`): a local failure, another
        parameter order or gradient presence, or other GradScaler controls fail every rank the same way, and a
        NaN/Inf gradient on any rank skips the step on all of them.

        Returns:
            ``(closure's loss, plan, skip, deferred)``; ``skip`` says why the step must change nothing (GradScaler
            overflow, or a NaN/Inf gradient under ``nonfinite="skip"``), ``None`` when it runs; ``deferred``: the
            NaN/Inf policy was left to the step itself (:meth:`_defers_finite_check`).

        Raises:
            StepError, ConfigError: see :meth:`_prepare`, :meth:`_amp_skip`, :meth:`_check_finite` (a sharded
                optimizer raises StepError on every rank).
        """
        shard = self._any_shard()
        if shard is None:
            loss = self._evaluate_closure(closure)
            plan = self._prepare()
            if self._amp_skip(plan):
                return loss, plan, StepSkip(nonfinite=False), False
            self._check_fresh_under_capture(plan)
            if self._defers_finite_check(plan):
                return loss, plan, None, True
            bad = self._check_finite(plan, later=self._first_gradients_checked_later(plan))
            return loss, plan, StepSkip(nonfinite=True, names=tuple(bad)) if bad else None, False
        loss, plan, failure, overflow, present, bad = None, [], None, False, False, []
        try:
            loss = self._evaluate_closure(closure)
            plan = self._prepare()
            present = amp_controls_present(self)
            overflow = self._amp_skip(plan)
            if not overflow:
                bad = self._check_finite(plan)
        except Exception as exc:  # shared with every rank before anyone raises
            failure = exc
        has_grad = {id(item.param) for work in plan for item in work}
        presence = [id(p) in has_grad for _g, _i, p, _n in self._iter_params()]
        overflow, nonfinite = agree(
            self.kind, "step", shard, failure, self._identity(), presence, (present, overflow), bool(bad)
        )
        if overflow:
            return loss, plan, StepSkip(nonfinite=False), False
        return loss, plan, StepSkip(nonfinite=True, names=tuple(bad)) if nonfinite else None, False

    def _record_skip(self, skip: StepSkip) -> None:
        """Count and report a step skipped for NaN/Inf gradients (nothing else changes)."""
        if skip.nonfinite:
            self._skipped_steps += 1
            warn_user(skip_message(self.kind, skip.names, self._skipped_steps))

    @property
    def skipped_steps(self) -> int:
        """Number of ``step()`` calls skipped because a gradient held NaN/Inf (``nonfinite="skip"``); saved in
        checkpoints. GradScaler's own overflow skips are not counted (the scaler reports those)."""
        self._settle_pending_check()
        return self._skipped_steps

    def _check_fresh_under_capture(self, plan: list[list[WorkItem]]) -> None:
        """Subclass hook: refuse a parameter's first step inside a trace or capture (raise StepError)."""

    def _defers_finite_check(self, plan: list[list[WorkItem]]) -> bool:
        """Subclass hook: True when the step itself applies the ``nonfinite`` policy before its first write (then
        the preflight does not read the gradients for it)."""
        return False

    def _first_gradients_checked_later(self, plan: list[list[WorkItem]]) -> frozenset[int]:
        """Subclass hook: ``id`` of the parameters whose first gradients the step itself checks (under the
        ``nonfinite`` policy, before its first write) in a read it makes anyway; the preflight skips them."""
        return frozenset()

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """Read by ``torch.amp.GradScaler.step``: true when some present gradient is fp16 (the scaler cannot
        unscale those), so it passes ``found_inf``/``grad_scale`` and lets :meth:`step` skip or unscale; false
        otherwise, keeping the ordinary path (the scaler unscales and skips ``step`` on overflow)."""
        return wants_native_amp(p.grad for _g, _i, p, _n in self._iter_params())

    def _amp_skip(self, plan: list[list[WorkItem]]) -> bool:
        """The optimizer side of GradScaler's protocol (see :mod:`gefen.amp`), run after the gradient preflight
        and before anything changes. Returns True when this step must be skipped (overflow: nothing changes);
        otherwise the gradients have been unscaled in place (when they carried a scale).

        Raises:
            StepError: malformed ``found_inf``/``grad_scale`` controls (nothing changed).
        """
        controls = read_amp_controls(self, self.kind)
        if controls is None:
            return False
        if controls.overflow:
            return True
        if controls.grad_scale is not None:
            unscale_grads_([item.grad for work in plan for item in work], controls.grad_scale)
        return False

    def _check_finite(self, plan: list[list[WorkItem]], later: frozenset[int] = frozenset()) -> list[str]:
        """Apply the ``nonfinite`` policy (see :mod:`gefen.nonfinite`) to the step's gradients; one host read.

        ``"skip"`` and ``"raise"`` check every gradient, ``"propagate"`` only the first gradient of a parameter
        without state (its period search and the codebook need finite values); none of the parameters in
        ``later`` (see :meth:`_first_gradients_checked_later`). Inside a
        :class:`gefen.GefenMuonHybrid` step, which applied the policy to both halves in its preflight, nothing is
        checked twice.

        Returns:
            Under ``"skip"``, the names of the unusable gradients (the step must be skipped when non-empty);
            otherwise ``[]``.

        Raises:
            StepError: naming the first such parameter, under ``"raise"`` or for a first gradient under
                ``"propagate"``; nothing has been changed.
        """
        if self.__dict__.get("_finite_checked"):  # a GefenMuonHybrid already applied the policy to this step
            return []
        everything = self.nonfinite != "propagate"
        named = [
            (item.name, item.grad)
            for work in plan
            for item in work
            if (everything or STEP not in self.state.get(item.param, ())) and id(item.param) not in later
        ]
        return self._apply_finite_policy(unusable_names(named), everything)

    def _apply_finite_policy(self, bad: list[str], everything: bool = True) -> list[str]:
        """The ``nonfinite`` policy's answer to the names of the unusable gradients ``bad`` (in step order).

        Args:
            bad: the parameters whose gradients hold NaN/Inf or values beyond :func:`gefen.amp.usable_bound`.
            everything: the policy checked every gradient (``False``: only first gradients, under "propagate").

        Returns:
            ``bad`` under ``"skip"`` (the step must change nothing when it is not empty), ``[]`` when it is empty.

        Raises:
            StepError: naming ``bad[0]`` under any other policy; nothing has been changed.
        """
        if not bad or self.nonfinite == "skip":
            return bad
        raise nonfinite_error(self.kind, bad[0], policy_name(self.deterministic) if everything else None)

    def _check_group(self, group: Mapping[str, Any], index: int) -> None:
        """Subclass hook: extra per-group validation of a new group (``add_param_group``, with its tensors in
        ``params``), of every group at step time and of every saved group on load (raise ConfigError)."""

    def _check_group_tensors(
        self, group: Mapping[str, Any], tensors: list[Tensor], where: str, labels: list[str]
    ) -> None:
        """Subclass hook: validate a new group's options against its tensors (raise ConfigError naming the
        parameter by ``labels[i]``: its name, when the caller gave one, and its position)."""

    def _second_moment_kind(self, param: Tensor, group: Mapping[str, Any]) -> SecondMomentKind:
        raise NotImplementedError

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """``torch.optim`` state dict plus the ``"gefen"`` metadata entry (see :mod:`gefen.checkpoint`).

        The metadata is added by the first state-dict post-hook, so hooks registered by the user see it.

        Returns:
            ``{"state": ..., "param_groups": ..., "gefen": {...}}``; loadable with ``weights_only=True``.
        """
        self._settle_pending_check()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by :meth:`state_dict`, or refuse it without changing anything.

        Saved dtypes are kept (uint8 codes, fp32 magnitudes and second moments) whatever the parameter dtype,
        and every tensor is placed on its parameter's device. Load pre-hooks run first, post-hooks only on
        success.

        Raises:
            CheckpointError: the dict does not fit this optimizer (see :func:`gefen.checkpoint.stage_load`);
                the optimizer and the caller's dict are left unchanged.
        """
        self._settle_pending_check()  # the last step belongs to the state before the load
        shard = self._any_shard()
        if shard is None:
            staged = self._stage_load(state_dict)
        else:  # every rank validates its rows; all publish or all refuse
            failure = None
            try:
                staged = self._stage_load(state_dict)
            except Exception as exc:
                failure = exc
            agree(self.kind, "load_state_dict", shard, failure, self._identity())
        self._publish_load(staged)
        self._run_load_post_hooks()

    def _stage_load(self, state_dict: Any) -> StagedLoad:
        """Run the load pre-hooks on a shallow copy, then validate and build everything (changes nothing).

        Raises:
            CheckpointError: see :func:`gefen.checkpoint.stage_load`.
        """
        sd: Any = dict(state_dict) if isinstance(state_dict, Mapping) else state_dict
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            out = hook(self, sd)
            if out is not None:
                sd = out
        return stage_load(
            sd,
            optimizer_kind=self.kind,
            live_groups=self.param_groups,
            second_moment_kind=self._second_moment_kind,
            codebook_device=self._codebook_device(),
            deterministic=self.deterministic,
            capturable=self.capturable,
            group_validator=self._check_group,
            shard_of=self._shard_of,
            hyperparameters=self.defaults.keys(),
            live_metadata=_live_metadata(self),
            live_state=self.state,
        )

    def _publish_load(self, staged: StagedLoad) -> None:
        """Publish a staged load: plain assignments only, nothing here can fail half-way."""
        self.state = defaultdict(dict, staged.state)
        self.param_groups = staged.param_groups
        self._set_codebook(staged.codebook)
        self._set_global_step(staged.global_step)
        self._skipped_steps = staged.metadata.skipped_steps
        self._backends.forget_state()  # plans built on the old state (device step counters) are dropped

    def _run_load_post_hooks(self) -> None:
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _set_codebook(self, codebook: Tensor | None) -> None:
        """Publish a codebook and drop every cache derived from another one (cannot fail).

        Cache entries are ``(codebook, value)`` pairs; those built for this very tensor (e.g. while a step checked
        its kernels before publishing it) are kept.
        """
        self._codebook = codebook
        self._tables = {key: entry for key, entry in self._tables.items() if entry[0] is codebook}

    def _codebook_device(self) -> torch.device:
        """The first parameter's device (groups may be empty, as in torch; the CPU when every one is)."""
        for group in self.param_groups:
            for p in group["params"]:
                return local(p).device
        return torch.device("cpu")

    # ------------------------------------------------------------------ accounting
    @property
    def codebook(self) -> Tensor | None:
        """The learned fp32 (256,) codebook (read-only view), or ``None`` before the first step."""
        return self._codebook

    @property
    def global_step(self) -> int:
        """Number of ``step()`` calls that updated at least one parameter (a host read of the device counter
        under ``capturable=True``)."""
        self._settle_pending_check()
        if self._global_step_t is not None:
            return int(self._global_step_t)
        return self._global_step

    def _set_global_step(self, value: int) -> None:
        """Publish a global step (cannot fail; the device counter is filled in place, keeping its address for
        captured graphs)."""
        self._global_step = value
        if self._global_step_t is not None:
            self._global_step_t.fill_(value)

    def _advance_global_step(self) -> None:
        if self._global_step_t is not None:
            self._global_step_t.add_(1)
        else:
            self._global_step += 1

    def state_bytes(self) -> int:
        """Persistent optimizer state in bytes, measured from the live tensors (codebook included)."""
        total = sum(state_bytes(s) for k, s in self.state.items() if isinstance(k, Tensor))
        return total + (tensor_bytes(self._codebook) if self._codebook is not None else 0)

    def state_report(self) -> list[dict[str, Any]]:
        """Per-parameter report, in param-group order.

        Returns:
            One dict per parameter: ``name`` (str), ``shape`` (tuple), ``numel`` (int), ``period`` (int or
            ``None`` before its first update), ``second_moment`` (``"block"``, ``"factored"``, ``"momentum"``
            (GefenMuon) or ``None``), ``layout`` (str or ``None``: ``"factored"``, ``"blocks"``, ``"blocks
            (flattened: degenerate shape)"`` for a shape whose rows are too short to hold a block, see
            :func:`gefen.state.layout_name`), ``state_bytes`` (int, bytes; this rank's, when sharded), ``backend``
            (str or ``None``: the step backend that ran the parameter's latest step in this process, ``"native"``,
            ``"eager"``, ``"compiled"``, ``"triton"`` or ``"per-parameter device"``; for a sharded parameter, the
            one that stepped this rank's shard; ``None`` before its first step here, e.g. right after a load).
        """
        self._settle_pending_check()
        rows = []
        for _g, _i, p, name in self._iter_params():
            st = self.state.get(p, {})
            view = ParamState.from_dict(local_state(st)) if STEP in st else None
            period = None if view is None else view.period
            kind = None if view is None else view.kind
            layout = None if view is None else layout_name(tuple(p.shape), view.period, view.kind)
            rows.append(
                {
                    "name": name,
                    "shape": tuple(p.shape),
                    "numel": p.numel(),
                    "period": period,
                    "second_moment": kind,
                    "layout": layout,
                    "state_bytes": state_bytes(st),
                    "backend": self._stepped_by.get(id(p)),
                }
            )
        return rows

    @staticmethod
    def _evaluate_closure(closure: Callable[[], Any] | None) -> Any:
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()
