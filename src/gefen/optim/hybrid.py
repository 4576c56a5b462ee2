"""``GefenMuonHybrid``: whole-model Muon — 2-D hidden weights on :class:`GefenMuon`, the rest on a backup
(:class:`Gefen` or ``torch.optim.AdamW``) — behaving as one ``torch.optim.Optimizer``.

Which parameter goes where (algorithm.md §8.1) is :mod:`gefen.optim.routing`'s rule; like any ``torch.optim``
optimizer the hybrid holds every tensor it is given, trainable or frozen, and trains it once it has a gradient.
"""

from __future__ import annotations

import copy
import warnings
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
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
from gefen.checkpoint_hybrid import (
    HYBRID_HALF_KEY,
    HYBRID_METADATA_KEY,
    build_hybrid_state_dict,
    check_adamw_state,
    hybrid_metadata,
    split_hybrid_state_dict,
)
from gefen.errors import CheckpointError, ConfigError, StepError
from gefen.hyperparams import check_betas, check_eps, check_flags, check_group, check_lr, check_weight_decay
from gefen.kernels import resolve_backend_option
from gefen.kernels.compiled import host_only
from gefen.nonfinite import resolve_nonfinite, skip_message
from gefen.optim._base import StepSkip, WorkItem, iter_named_params
from gefen.optim._capture import check_not_inference
from gefen.optim.gefen import Gefen
from gefen.optim.muon import GefenMuon
from gefen.optim.routing import (
    BACKUP_OPTIMIZERS,
    DEFAULT_BACKUP_SUBSTRINGS,
    goes_to_muon,
    nothing_for_muon,
    split_params_for_muon,
    validate_split,
)
from gefen.sharding import local

__all__ = [
    "DEFAULT_BACKUP_SUBSTRINGS",
    "BACKUP_OPTIMIZERS",
    "split_params_for_muon",
    "validate_split",
    "GefenMuonHybrid",
]


class _GroupsView(list):  # type: ignore[type-arg]
    """``param_groups`` of the hybrid: the children's groups (live dicts), read-only as a list."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("GefenMuonHybrid.param_groups is a view of its two children; change the groups' dicts.")

    append = extend = insert = remove = pop = clear = __setitem__ = __delitem__ = __iadd__ = _refuse  # type: ignore[assignment]


class _StateView(MutableMapping):  # type: ignore[type-arg]
    """``state`` of the hybrid: a parameter's entry lives in the child that owns it; any other key (torch's
    ``state`` is a ``defaultdict(dict)`` that takes any key) lives in the hybrid's own table, with the same
    ``defaultdict`` behaviour, and is saved and loaded as-is, as ``torch.optim`` does."""

    def __init__(self, owner: GefenMuonHybrid) -> None:
        self._owner = owner

    def _table(self, key: Any) -> MutableMapping[Any, Any]:
        child = self._owner._owner_of(key)
        return self._owner._extra_state if child is None else child.state

    def __getitem__(self, key: Any) -> Any:
        return self._table(key)[key]

    def __contains__(self, key: object) -> bool:  # without creating an entry, as a defaultdict's ``in``
        return key in self._table(key)

    def get(self, key: Any, default: Any = None) -> Any:  # without creating an entry, as a defaultdict's ``get``
        return self._table(key).get(key, default)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._table(key)[key] = value

    def __delitem__(self, key: Any) -> None:
        del self._table(key)[key]

    def __iter__(self) -> Iterator[Any]:
        for child in self._owner._children():
            yield from child.state
        yield from self._owner._extra_state

    def __len__(self) -> int:
        return sum(len(child.state) for child in self._owner._children()) + len(self._owner._extra_state)


def _step_without_global_hooks(child: torch.optim.Optimizer) -> Any:
    """``child.step()`` as torch's step wrapper runs it (profiler range, the child's own pre/post hooks), minus
    the *global* hooks (``torch.optim.optimizer.register_optimizer_step_pre_hook`` / ``_post_hook``, which the
    profiler's step tracker uses): they fire once, around the hybrid's own step."""
    step = type(child).step
    inner = step.__wrapped__ if getattr(step, "hooked", False) else step
    args: tuple[Any, ...] = (child,)
    kwargs: dict[str, Any] = {}
    with torch.autograd.profiler.record_function(f"Optimizer.step#{type(child).__name__}.step"):
        for pre_hook in child._optimizer_step_pre_hooks.values():
            result = pre_hook(child, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(f"{pre_hook} must return None or a tuple of (new_args, new_kwargs).")
                args, kwargs = result
        out = inner(*args, **kwargs)
        child._optimizer_step_code()
        for post_hook in child._optimizer_step_post_hooks.values():
            post_hook(child, args, kwargs)
    return out


#: The hook registries torch.optim.Optimizer keeps per instance (the hybrid keeps its own).
_HOOK_REGISTRIES = tuple(
    f"_optimizer_{kind}_hooks"
    for kind in (
        "step_pre",
        "step_post",
        "state_dict_pre",
        "state_dict_post",
        "load_state_dict_pre",
        "load_state_dict_post",
    )
)


class GefenMuonHybrid(torch.optim.Optimizer):
    """Whole-model Muon: :class:`GefenMuon` for 2-D hidden weights, Gefen or AdamW for everything else.

    Behaves as one ``torch.optim.Optimizer``: ``param_groups`` is a live view of the Muon child's groups then
    the backup's (LR schedulers work; the hybrid's ``lr`` is the Muon lr, ``backup_lr`` the backup's);
    ``state`` routes to the owning child; ``step(closure)`` runs the closure once, validates both children's
    gradients, then steps the Muon child first and the backup second; ``zero_grad`` forwards;
    ``state_dict()`` is torch.optim's layout over both halves (:mod:`gefen.checkpoint_hybrid`: ``state`` by
    position, groups naming their ``hybrid_half``, a ``gefen_hybrid`` entry), so tools written for torch.optim
    (the DCP helpers) take the hybrid itself, and ``load_state_dict`` validates both halves before either
    changes; ``add_param_group`` routes a group to its half. Parameters frozen at construction are held and train
    once unfrozen; torch's global step hooks fire once per hybrid step; ``state`` takes keys that are not
    parameters (saved and loaded as-is).

    Args:
        model_or_named_params: an ``nn.Module`` (routing by module type and name) or ``(name, param)`` pairs
            (routing by name and ndim), split by :func:`split_params_for_muon`.
        lr: Muon's lr η (with ``adjust_lr_fn="match_rms_adamw"`` an AdamW-scale value fits).
        backup_optimizer: ``"gefen"`` (block second moment, ``factored_v_2d=False`` as algorithm.md §8.2) or
            ``"adamw"`` (``torch.optim.AdamW``).
        backup_factored_v_2d: the Gefen backup's 2-D weights keep the factored second moment (as :class:`Gefen`'s
            default) instead of the block one; for fine-tuning a fresh head (docs/muon_ablation.md: 80 % against
            67 % on MiniLM's new pooler and classifier). Ignored with ``backup_optimizer="adamw"``.
        backup_lr: the backup's lr (default ``lr``).
        weight_decay, muon_weight_decay, backup_weight_decay: decoupled decay (the specific ones default to
            ``weight_decay``).
        betas, eps: the backup's Adam betas and eps (Muon keeps its own eps 1e-7).
        momentum, nesterov, ns_steps, ns_schedule, adjust_lr_fn, normuon, normuon_beta2, normuon_eps,
            sharded_mode: Muon options (see :class:`GefenMuon`); hybrid defaults ``ns_schedule="standard"`` (5
            iterations; ``"tuned3"``, algorithm.md §8.2's default, cost 4.5 % eval loss on the demo task:
            docs/muon_ablation.md), ``normuon=True``, ``adjust_lr_fn="match_rms_adamw"``.
        backup_substrings: name fragments forcing the backup (default :data:`DEFAULT_BACKUP_SUBSTRINGS`).
        backend, fused, deterministic, capturable, nonfinite: forwarded to both Gefen children (see :class:`Gefen`;
            ``fused`` is the deprecated alias of ``backend``, folded in here); with an
            AdamW backup, ``deterministic``/``nonfinite`` are enforced on its gradients by the hybrid, and
            ``capturable=True`` is refused. Under ``nonfinite="skip"`` (the default) a NaN/Inf gradient in either
            half skips the whole hybrid step (neither half changes; counted in :attr:`skipped_steps`).

    Raises:
        ConfigError: no parameter at all, an unknown ``backup_optimizer``, invalid hyperparameters, a policy
            combination that cannot be honoured (see :class:`Gefen`).
        TypeError: bare tensors instead of a model or ``(name, param)`` pairs; a non-bool ``deterministic`` or
            ``capturable``.

    Source: algorithm.md §8.
    """

    def __init__(
        self,
        model_or_named_params: nn.Module | Iterable[tuple[str, Tensor]],
        *,
        lr: float,
        backup_optimizer: str = "gefen",
        backup_lr: float | None = None,
        weight_decay: float = 0.0,
        muon_weight_decay: float | None = None,
        backup_weight_decay: float | None = None,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_schedule: str | Sequence[Sequence[float]] | None = "standard",
        adjust_lr_fn: str | None = "match_rms_adamw",
        normuon: bool = True,
        normuon_beta2: float = 0.95,
        normuon_eps: float = 1e-8,
        sharded_mode: str = "exact",
        backup_substrings: Sequence[str] = DEFAULT_BACKUP_SUBSTRINGS,
        backend: str = "auto",
        fused: bool | None = None,
        deterministic: bool = False,
        capturable: bool = False,
        nonfinite: str | None = None,
        backup_factored_v_2d: bool = False,
    ) -> None:
        check_flags(
            "GefenMuonHybrid",
            {"deterministic": deterministic, "capturable": capturable, "backup_factored_v_2d": backup_factored_v_2d},
        )
        check_flags("GefenMuonHybrid", {"fused": fused}, optional=("fused",))
        self.nonfinite = resolve_nonfinite("GefenMuonHybrid", nonfinite, deterministic, capturable)
        self.deterministic = deterministic
        self.capturable = capturable
        self._skipped_steps = 0
        self._extra_state: defaultdict[Any, Any] = defaultdict(dict)
        if capturable and backup_optimizer == "adamw":
            raise ConfigError(
                "GefenMuonHybrid(capturable=True, backup_optimizer='adamw') is not supported: build the hybrid "
                "with backup_optimizer='gefen', or use capturable=False."
            )
        if backup_optimizer not in BACKUP_OPTIMIZERS:
            raise ConfigError(f"backup_optimizer={backup_optimizer!r} must be one of {BACKUP_OPTIMIZERS}.")
        muon, backup = split_params_for_muon(model_or_named_params, backup_substrings)
        validate_split(muon, backup, model_or_named_params if isinstance(model_or_named_params, nn.Module) else None)
        if not muon and not backup:
            raise ConfigError("GefenMuonHybrid got no parameter.")
        # checked first under the hybrid's own argument names (backup_lr, not backup['lr'])
        where = "GefenMuonHybrid: "
        check_lr(lr, where + "lr")
        check_weight_decay(weight_decay, where + "weight_decay")
        check_betas(betas, where + "betas")
        check_eps(eps, where + "eps")
        for name, value in (
            ("backup_lr", backup_lr),
            ("muon_weight_decay", muon_weight_decay),
            ("backup_weight_decay", backup_weight_decay),
        ):
            if value is not None:
                (check_lr if name == "backup_lr" else check_weight_decay)(value, where + name)
        message = nothing_for_muon(muon, backup, backup_substrings, backup_optimizer)
        if message is not None:
            warnings.warn(message, stacklevel=2)
        if adjust_lr_fn in (None, "original"):
            warnings.warn(
                "GefenMuonHybrid with adjust_lr_fn='original' scales Muon's lr by sqrt(max(1, R/C)) only: an "
                "AdamW-scale lr will be far too small for Muon; 'match_rms_adamw' (the default) fixes that.",
                stacklevel=2,
            )
        self.backup_optimizer = backup_optimizer
        self._backup_substrings = tuple(s.lower() for s in backup_substrings)
        wd = weight_decay
        policies: dict[str, Any] = {
            "backend": resolve_backend_option("GefenMuonHybrid", backend, fused, ConfigError),
            "deterministic": deterministic,
            "capturable": capturable,
            "nonfinite": self.nonfinite,
        }
        self.muon: GefenMuon | None = None
        self.backup: torch.optim.Optimizer | None = None
        if muon:
            self.muon = GefenMuon(
                muon,
                lr=lr,
                weight_decay=wd if muon_weight_decay is None else muon_weight_decay,
                momentum=momentum,
                nesterov=nesterov,
                ns_steps=ns_steps,
                ns_schedule=ns_schedule,
                adjust_lr_fn=adjust_lr_fn,
                normuon=normuon,
                normuon_beta2=normuon_beta2,
                normuon_eps=normuon_eps,
                sharded_mode=sharded_mode,
                **policies,
            )
        if backup:
            blr = lr if backup_lr is None else backup_lr
            bwd = wd if backup_weight_decay is None else backup_weight_decay
            if backup_optimizer == "gefen":
                self.backup = Gefen(
                    backup,
                    lr=blr,
                    betas=betas,
                    eps=eps,
                    weight_decay=bwd,
                    factored_v_2d=backup_factored_v_2d,
                    **policies,
                )
            else:
                self.backup = torch.optim.AdamW(
                    [{"params": [p for _, p in backup], "param_names": [n for n, _ in backup]}],
                    lr=blr,
                    betas=betas,
                    eps=eps,
                    weight_decay=bwd,
                )
        self._mark_groups()
        first = self._children()[0]
        self.defaults = first.defaults
        for name in _HOOK_REGISTRIES:
            setattr(self, name, OrderedDict())
        self._zero_grad_profile_name = "Optimizer.zero_grad#GefenMuonHybrid.zero_grad"
        self._patch_step_function()

    @classmethod
    def from_model(cls, model: nn.Module, **kwargs: Any) -> GefenMuonHybrid:
        """``GefenMuonHybrid(model, **kwargs)``: routing by module type and name (see the class docstring)."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"from_model needs an nn.Module, got {type(model).__name__}")
        return cls(model, **kwargs)

    @property
    def compile_time_s(self) -> float:
        """Seconds both children spent compiling fused step kernels in this process (``0.0`` on eager paths)."""
        return sum(float(getattr(child, "compile_time_s", 0.0)) for child in self._children())

    def _children(self) -> list[torch.optim.Optimizer]:
        return [c for c in (self.muon, self.backup) if c is not None]

    def _mark_groups(self) -> None:
        """Give every live group the hybrid's carriers: its ``hybrid_half`` and a ``None`` stand-in for the
        ``gefen_hybrid`` mirror (torch's flattened DCP layout keeps only the group keys the live groups have; see
        :mod:`gefen.checkpoint_hybrid`)."""
        for half, child in (("muon", self.muon), ("backup", self.backup)):
            for group in [] if child is None else child.param_groups:
                group.update({HYBRID_HALF_KEY: half, HYBRID_METADATA_KEY: None})

    def _owner_of(self, param: Any) -> torch.optim.Optimizer | None:
        """The half holding ``param`` (``None``: neither), from a table keyed by tensor identity that is rebuilt
        when a lookup misses (after ``add_param_group`` or an edit of a group's ``params`` list)."""
        entry = self.__dict__.get("_owners", {}).get(id(param))
        if entry is None or entry[1] is not param:
            table = {id(p): (c, p) for c in self._children() for g in c.param_groups for p in g["params"]}
            self._owners = table
            entry = table.get(id(param))
        return None if entry is None else entry[0]

    def __getstate__(self) -> dict[str, Any]:
        """Pickle/deepcopy support: the two children (each pickles its own state and codebook) and settings.

        Like ``torch.optim.Optimizer``, hooks and an LR scheduler's instance-level ``step`` wrapper are not
        pickled (they hold closures); the copy starts without them.
        """
        skip = ("step", "_owners")  # a scheduler's wrapper; the identity table (rebuilt on use)
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_optimizer_") and k not in skip}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        for name in _HOOK_REGISTRIES:
            self.__dict__.setdefault(name, OrderedDict())
        self.__dict__.setdefault("_skipped_steps", 0)
        self.__dict__.setdefault("_extra_state", defaultdict(dict))
        self._mark_groups()

    # ------------------------------------------------------------------ torch.optim surface
    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        """The Muon child's groups followed by the backup's (the children's own dicts)."""
        return _GroupsView(g for c in self._children() for g in c.param_groups)

    @param_groups.setter
    def param_groups(self, value: Any) -> None:
        raise TypeError("GefenMuonHybrid.param_groups cannot be assigned; it is a view of the two children.")

    @property  # type: ignore[override]
    def state(self) -> _StateView:
        """Per-parameter state, routed to the owning child."""
        return _StateView(self)

    @state.setter
    def state(self, value: Any) -> None:
        raise TypeError("GefenMuonHybrid.state cannot be assigned; load a state_dict instead.")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group to the half that owns it (``torch.optim`` semantics; validated by that half).

        The half is the group's ``"hybrid_half"`` entry (``"muon"`` or ``"backup"``) when given, else the
        constructor's rule (algorithm.md §8.1) applied to each parameter: 2-D and no backup substring in its name
        (from ``(name, tensor)`` pairs or ``param_names``; a bare tensor has no name) goes to Muon, the rest to the
        backup. The new group is then the last group of its half in :attr:`param_groups`.

        Raises:
            TypeError: ``param_group`` is not a dict, or holds something that is not a tensor.
            ConfigError: the rule sends the group's parameters to different halves (split the group or pass
                ``hybrid_half``), an unknown ``hybrid_half``, a half this hybrid was built without, a parameter
                already in the hybrid, or whatever the half refuses (invalid hyperparameters, a non-2-D
                parameter for Muon, ...).
        """
        if not isinstance(param_group, dict):
            raise TypeError(f"GefenMuonHybrid param_group must be a dict, got {type(param_group).__name__}.")
        group = dict(param_group)
        half = group.pop(HYBRID_HALF_KEY, None)
        raw = group.get("params", [])
        items = [raw] if isinstance(raw, Tensor) else list(raw)
        names = group.get("param_names")
        named = []
        for i, item in enumerate(items):
            name, tensor = item if isinstance(item, tuple) and len(item) == 2 else (None, item)
            if not isinstance(tensor, Tensor):
                raise TypeError(f"GefenMuonHybrid param_group['params'][{i}] is a {type(tensor).__name__}.")
            named.append((name if name is not None else (names[i] if names else ""), tensor))
        owned = {id(p) for g in self.param_groups for p in g["params"]}
        taken = [name or f"params[{i}]" for i, (name, p) in enumerate(named) if id(p) in owned]
        if taken:
            raise ConfigError(f"GefenMuonHybrid.add_param_group: {taken[0]} is already in this hybrid.")
        if half is None:
            routes = [(n, "muon" if goes_to_muon(n, p, set(), self._backup_substrings) else "backup") for n, p in named]
            if len({h for _, h in routes}) > 1:
                listed = ", ".join(f"{n or f'params[{i}]'} -> {h}" for i, (n, h) in enumerate(routes[:6]))
                raise ConfigError(
                    f"GefenMuonHybrid.add_param_group cannot route one group to both halves ({listed}); split it "
                    "into one group per half, or pass 'hybrid_half': 'muon' or 'backup'."
                )
            half = routes[0][1] if routes else "backup"
        if half not in ("muon", "backup"):
            raise ConfigError(f"GefenMuonHybrid.add_param_group: hybrid_half={half!r} must be 'muon' or 'backup'.")
        child = self.muon if half == "muon" else self.backup
        if child is None:
            raise ConfigError(
                f"GefenMuonHybrid.add_param_group: this hybrid has no {half} half (nothing went there at "
                "construction), so it cannot take the group; build the hybrid with all the parameters it will train."
            )
        # the halves hold named parameters (torch requires all groups named or none): name the unnamed ones
        index = len(self.param_groups)
        group["params"] = [(n or f"param_groups[{index}][{i}]", p) for i, (n, p) in enumerate(named)]
        group.pop("param_names", None)
        child.add_param_group(group)
        self._mark_groups()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forward to both children."""
        for child in self._children():
            child.zero_grad(set_to_none=set_to_none)

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """True when some present gradient of either half is fp16 (see :mod:`gefen.amp`); the hybrid then skips
        or unscales both halves at once."""
        return wants_native_amp(p.grad for g in self.param_groups for p in g["params"])

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Run the closure once, validate both children's gradients, then step Muon and then the backup.

        With GradScaler's optimizer-side protocol (fp16 gradients) the overflow decision is taken once for both
        halves: on overflow neither changes; otherwise every gradient of both is unscaled once, then each child
        steps without seeing the scaler's controls.

        Raises:
            StepError: a gradient of either half is invalid, non-finite under ``nonfinite="raise"``, or the
                GradScaler controls are malformed (nothing changed in either).
            ConfigError: an invalid hyperparameter in either half.
        """
        if self.capturable:
            return self._step(closure)
        return self._host_step(closure)

    @host_only
    def _host_step(self, closure: Callable[[], Any] | None) -> Any:
        """The ``capturable=False`` step, never traced by ``torch.compile`` (see :class:`gefen.Gefen`)."""
        return self._step(closure)

    def _step(self, closure: Callable[[], Any] | None) -> Any:
        check_not_inference("GefenMuonHybrid")
        shard = next((s for s in (c._any_shard() for c in self._children() if isinstance(c, Gefen)) if s), None)
        if shard is None:
            loss, skip = self._preflight(closure)
        else:  # sharded (FSDP2): every rank learns of any rank's failure before a child enters a collective
            loss, skip, failure = None, None, None
            try:
                loss, skip = self._preflight(closure)
            except Exception as exc:
                failure = exc
            names = {id(p): n for c in self._children() for _g, _i, p, n in iter_named_params(c.param_groups)}
            params = [p for g in self.param_groups for p in g["params"]]
            identity = [(names.get(id(p), "?"), tuple(p.shape), str(p.dtype)) for p in params]
            presence = [p.grad is not None for p in params]
            present = amp_controls_present(self)
            overflow = skip is not None and not skip.nonfinite
            bad = skip.names if skip is not None and skip.nonfinite else ()
            overflow, nonfinite = agree(
                "GefenMuonHybrid", "step", shard, failure, identity, presence, (present, overflow), bool(bad)
            )
            skip = StepSkip(False) if overflow else StepSkip(True, bad) if nonfinite else None
        if skip is not None:  # nothing changes in either half
            if skip.nonfinite:
                self._skipped_steps += 1
                warn_user(skip_message("GefenMuonHybrid", skip.names, self._skipped_steps))
            return loss
        for child in self._children():  # the NaN/Inf policy ran above over both halves: not again per child
            if isinstance(child, Gefen):
                child._finite_checked = True
            try:
                _step_without_global_hooks(child)
            finally:
                child.__dict__.pop("_finite_checked", None)
        return loss

    def _preflight(self, closure: Callable[[], Any] | None) -> tuple[Any, StepSkip | None]:
        """The closure, both children's gradient checks, the GradScaler decision (unscaling unless it found an
        overflow) and the NaN/Inf policy over both halves at once, before either half changes. Returns
        ``(loss, skip)`` (see :class:`gefen.optim._base.StepSkip`; ``None``: the step runs)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plans: list[tuple[torch.optim.Optimizer, list[Any]]] = []
        for child in self._children():
            if isinstance(child, Gefen):
                plans.append((child, [item for work in child._prepare() for item in work]))
            else:
                plans.append((child, _check_torch_child_grads(child)))
        controls = read_amp_controls(self, "GefenMuonHybrid")
        if controls is not None and controls.overflow:
            return loss, StepSkip(nonfinite=False)
        if controls is not None and controls.grad_scale is not None:
            unscale_grads_([item.grad for _, items in plans for item in items], controls.grad_scale)
        bad: list[str] = []
        for child, items in plans:  # before either half changes: NaN/Inf policy and first gradients
            if isinstance(child, Gefen):
                bad += child._check_finite([items])
            elif self.nonfinite != "propagate":
                bad += unusable_names([(item.name, local(item.grad)) for item in items])  # this rank's rows
                if bad and self.nonfinite == "raise":
                    raise nonfinite_error("GefenMuonHybrid", bad[0], policy_name(self.deterministic))
        return loss, StepSkip(nonfinite=True, names=tuple(bad)) if bad else None

    @property
    def skipped_steps(self) -> int:
        """Number of ``step()`` calls skipped (in both halves) because a gradient held NaN/Inf
        (``nonfinite="skip"``); saved in checkpoints."""
        return self._skipped_steps

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's layout over both halves (see :mod:`gefen.checkpoint_hybrid`): ``state`` keyed by position
        in :attr:`param_groups` order (the Muon groups, then the backup's), every saved group naming its half
        (``hybrid_half``) and carrying its half's metadata, and the hybrid's own ``gefen_hybrid`` entry
        (backup optimizer, ``deterministic``, ``skipped_steps``). The DCP helpers take the hybrid itself.

        The hybrid's own state-dict pre-hooks run first and its post-hooks last (each child runs its own too).
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        sd = build_hybrid_state_dict(
            {
                "muon": None if self.muon is None else self.muon.state_dict(),
                "backup": None if self.backup is None else self.backup.state_dict(),
            },
            self.backup_optimizer,
            self.deterministic,
            self._skipped_steps,
            self._extra_state,
        )
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            out = post_hook(self, sd)
            if out is not None:
                sd = out
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a hybrid checkpoint in three phases: check the layout, stage (fully validate) both halves, then
        commit both with plain assignments; only then run the children's and the hybrid's post-hooks.

        The hybrid's load pre-hooks run once on a shallow copy; a refused load changes neither half and runs no
        post-hook; a post-hook that raises finds both halves already at the new state (never half a hybrid).

        Accepts torch's layout (:meth:`state_dict`) and the gefen 0.1 layout ``{"muon", "backup",
        "backup_optimizer"}``, which migrates (see :func:`gefen.checkpoint_hybrid.split_hybrid_state_dict`).

        Raises:
            CheckpointError: not a hybrid checkpoint, another backup backend, a half present in one and missing in
                the other, or a half that fails its own validation.
        """
        sd: Any = dict(state_dict) if isinstance(state_dict, Mapping) else state_dict
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            out = hook(self, sd)
            if out is not None:
                sd = out
        live = hybrid_metadata(self.backup_optimizer, self.deterministic, self._skipped_steps)
        split = split_hybrid_state_dict(sd, self.backup_optimizer, self.deterministic, live)
        halves = {"muon": split.muon, "backup": split.backup}
        for half, child in (("muon", self.muon), ("backup", self.backup)):
            if (halves[half] is None) != (child is None):
                raise CheckpointError(f"the checkpoint's {half} half does not match this hybrid's (one is empty).")
        staged = [
            (child, _stage_half(child, halves[half], half))
            for half, child in (("muon", self.muon), ("backup", self.backup))
            if child is not None
        ]
        skipped = split.skipped_steps
        extra: defaultdict[Any, Any] = defaultdict(dict, copy.deepcopy(split.extra_state))  # before the commit
        for child, half_state in staged:  # commit: plain assignments
            if isinstance(child, Gefen):
                child._publish_load(half_state)
            else:
                child.__setstate__({"state": half_state.state, "param_groups": half_state.param_groups})
        self._skipped_steps = skipped
        self._extra_state = extra
        self._mark_groups()
        for child, _ in staged:
            if isinstance(child, Gefen):
                child._run_load_post_hooks()
            else:
                for post_hook in child._optimizer_load_state_dict_post_hooks.values():
                    post_hook(child)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)


def _check_torch_child_grads(child: torch.optim.Optimizer) -> list[WorkItem]:
    """The group and gradient checks of :meth:`gefen.optim._base.GefenOptimizer._prepare` for a torch backup
    (AdamW), so a bad hyperparameter or gradient there is refused before the Muon half steps. Returns the
    parameters with a gradient.

    Raises:
        ConfigError: an invalid lr, betas, eps or weight decay in a backup group (e.g. set by hand).
        StepError: a sparse, non-strided, complex, non-floating or wrongly shaped gradient.
    """
    items = []
    for g, group in enumerate(child.param_groups):
        check_group(group, f"GefenMuonHybrid backup param_groups[{g}]")
        names = group.get("param_names")
        for i, p in enumerate(group["params"]):
            grad = p.grad
            if grad is None:
                continue
            name = names[i] if names else f"backup param_groups[{g}][{i}]"
            if (
                grad.is_sparse
                or grad.layout != torch.strided
                or grad.is_complex()
                or not grad.is_floating_point()
                or grad.shape != p.shape
                or grad.device != p.device
            ):
                raise StepError(
                    f"GefenMuonHybrid: the gradient of {name} (layout {grad.layout}, dtype {grad.dtype}, shape "
                    f"{tuple(grad.shape)}) cannot be used by the AdamW backup; nothing was changed."
                )
            items.append(WorkItem(p, grad, name))
    return items


def _stage_half(child: torch.optim.Optimizer, half: Any, name: str) -> Any:
    """Stage one half without touching ``child``: a Gefen child through its own staged load; a torch (AdamW)
    child by loading a deep copy of the half into a throw-away twin over the same parameters (torch's own loader
    is not fail-before-mutation, and would share the caller's tensors) and checking the result.

    Returns:
        A :class:`gefen.checkpoint.StagedLoad` (Gefen) or the twin optimizer (AdamW), ready to commit.

    Raises:
        CheckpointError: naming the half.
    """
    try:
        if isinstance(child, Gefen):
            return child._stage_load(half)
        twin = type(child)([dict(g, params=list(g["params"])) for g in child.param_groups])
        twin.load_state_dict(copy.deepcopy(half))
        check_adamw_state(twin)
        return twin
    except CheckpointError as exc:
        raise CheckpointError(f"{name} half: {exc}") from exc
    except Exception as exc:
        raise CheckpointError(f"{name} half does not fit: {type(exc).__name__}: {exc}") from exc
