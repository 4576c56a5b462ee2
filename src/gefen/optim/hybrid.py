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
from gefen.optim._hybrid_groups import HALVES, group_spec, input_groups, place_groups, publish, same_groups
from gefen.optim._hybrid_report import half_state_bytes, hybrid_state_report
from gefen.optim._param_input import param_label, refuse_duplicates
from gefen.optim.gefen import Gefen
from gefen.optim.muon import GefenMuon
from gefen.optim.routing import (
    BACKUP_OPTIMIZERS,
    DEFAULT_BACKUP_SUBSTRINGS,
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

    Behaves as one ``torch.optim.Optimizer``: ``param_groups`` is a plain list in torch's order (the
    constructor's groups, then each ``add_param_group`` appended, whichever half owns it), each dict the one its
    half steps with, so writing ``param_groups[i]["lr"]`` (an LR scheduler, a fine-tuning callback) takes effect;
    the list may be edited, extended or assigned as a whole (Lightning's resume), and its new groups join their
    halves at the next call (:mod:`gefen.optim._hybrid_groups`); the hybrid's ``lr`` is the Muon lr, ``backup_lr``
    the backup's. ``state`` routes to the owning child; ``step(closure)`` runs the closure once, validates both
    children's gradients, then steps the Muon child first and the backup second; ``zero_grad`` forwards;
    ``state_dict()`` is torch.optim's layout over both halves (:mod:`gefen.checkpoint_hybrid`: ``state`` by
    position, groups in list order naming their ``hybrid_half``, ``param_names`` only where the parameters have
    names, a ``gefen_hybrid`` entry), so tools written for torch.optim (the DCP helpers) take the hybrid itself,
    and ``load_state_dict`` validates both halves before either changes. Parameters frozen at construction are
    held and train once unfrozen; torch's global step hooks fire once per hybrid step; ``state`` takes keys that
    are not parameters (saved and loaded as-is).

    Args:
        model_or_named_params: an ``nn.Module`` (routing by module type and name) or ``(name, param)`` pairs
            (routing by name and ndim), split by :func:`split_params_for_muon`; or, as ``torch.optim`` takes them,
            bare tensors (routing by ndim only: every 2-D tensor goes to Muon, embeddings and heads included, so a
            warning says so) or param-group dicts (each routed whole, as by :meth:`add_param_group`).
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
            combination that cannot be honoured (see :class:`Gefen`), a group dict the rule sends to both halves.
        TypeError: a single tensor, or parameters of mixed kinds; a non-bool ``deterministic`` or ``capturable``.
        ValueError: a parameter twice, some parameters or groups named and others not (torch's rule).

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
        specs, named, muon, backup, callers = input_groups(
            model_or_named_params, tuple(s.lower() for s in backup_substrings)
        )
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
        if not named and any(p.dim() == 2 for _, p in muon):
            warnings.warn(
                "GefenMuonHybrid got parameters without names: routing by shape only, every 2-D tensor goes to Muon "
                "(embeddings and output heads too). Pass the model or model.named_parameters() to keep those on the "
                "backup.",
                stacklevel=2,
            )
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
        self._child_options = {
            "muon": {
                "lr": lr,
                "weight_decay": wd if muon_weight_decay is None else muon_weight_decay,
                "momentum": momentum,
                "nesterov": nesterov,
                "ns_steps": ns_steps,
                "ns_schedule": ns_schedule,
                "adjust_lr_fn": adjust_lr_fn,
                "normuon": normuon,
                "normuon_beta2": normuon_beta2,
                "normuon_eps": normuon_eps,
                "sharded_mode": sharded_mode,
                **policies,
            },
            "backup": {
                "lr": lr if backup_lr is None else backup_lr,
                "betas": betas,
                "eps": eps,
                "weight_decay": wd if backup_weight_decay is None else backup_weight_decay,
                **({"factored_v_2d": backup_factored_v_2d, **policies} if backup_optimizer == "gefen" else {}),
            },
        }
        self.muon: GefenMuon | None = None
        self.backup: torch.optim.Optimizer | None = None
        for half in HALVES:
            mine = [spec for h, spec in specs if h == half]
            if mine:
                setattr(self, half, self._make_child(half, mine))
        taken = dict.fromkeys(HALVES, 0)
        groups = []
        for (half, _), caller in zip(specs, callers):  # the order given: the k-th group of a half is its child's k-th
            child_groups = getattr(self, half).param_groups
            if caller is not None:
                publish(child_groups, taken[half], caller)  # the caller's dict is the group, as in torch
            groups.append(child_groups[taken[half]])
            taken[half] += 1
        self._groups = groups
        self._named = named
        self._mark_groups()
        self._record_sync()
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
        """The halves that hold a group, Muon's first (the order they step in). A half whose every group left the
        list keeps its state, unused, until a group of it comes back."""
        return [c for c in (self.muon, self.backup) if c is not None and c.param_groups]

    def _halves(self) -> dict[str, torch.optim.Optimizer | None]:
        return {"muon": self.muon, "backup": self.backup}

    def _make_child(self, half: str, specs: list[dict[str, Any]]) -> torch.optim.Optimizer:
        """Build a half over its first groups with the constructor's options (at construction, or when a group of a
        half the hybrid was built without joins it)."""
        options = self._child_options[half]
        if half == "muon":
            return GefenMuon(specs, **options)
        if self.backup_optimizer == "gefen":
            return Gefen(specs, **options)
        return torch.optim.AdamW(specs, **options)

    def _mark_groups(self) -> None:
        """Give every live group the hybrid's carriers: its ``hybrid_half`` and a ``None`` stand-in for the
        ``gefen_hybrid`` mirror (torch's flattened DCP layout keeps only the group keys the live groups have; see
        :mod:`gefen.checkpoint_hybrid`)."""
        for half, child in self._halves().items():
            for group in [] if child is None else child.param_groups:
                group.update({HYBRID_HALF_KEY: half, HYBRID_METADATA_KEY: None})

    def _record_sync(self, halves: list[str] | None = None) -> None:
        """Remember the list and the children's lists as they agree now (:meth:`_sync` compares against it)."""
        if halves is None:
            known = {id(g): h for h, c in self._halves().items() if c is not None for g in c.param_groups}
            halves = [known[id(g)] for g in self._groups]
        self._synced = (list(self._groups), {h: list(c.param_groups) for h, c in self._halves().items() if c})
        self._group_halves = halves
        self.__dict__.pop("_owners", None)

    def _sync(self) -> None:
        """Bring the children in line with :attr:`param_groups` after the list was edited or assigned.

        A group a child gained behind the hybrid's back (its own ``add_param_group``) is appended to the list
        first. New dicts in the list are routed and validated (:func:`gefen.optim._hybrid_groups.place_groups`).

        Raises:
            TypeError, ValueError, ConfigError: a group of the list cannot be placed; nothing changed.
        """
        groups_then, children_then = self._synced
        halves_map = self._halves()
        moved = [
            h
            for h, c in halves_map.items()
            if c is not None and not same_groups(c.param_groups, children_then.get(h, []))
        ]
        if same_groups(self._groups, groups_then) and not moved:
            return
        if moved and same_groups(self._groups, groups_then):  # a child changed behind the hybrid's back: follow it
            live = {id(g): h for h, c in halves_map.items() if c is not None for g in c.param_groups}
            kept = [g for g in self._groups if id(g) in live]
            seen = {id(g) for g in kept}
            kept += [g for c in halves_map.values() if c is not None for g in c.param_groups if id(g) not in seen]
            self._groups[:] = kept
            for half, child in halves_map.items():
                if child is not None:
                    child.param_groups = [g for g in kept if live[id(g)] == half]
            self._mark_groups()
            self._record_sync()
            return
        halves = place_groups(
            self._groups,
            halves_map,
            named=self._named,
            substrings=self._backup_substrings,
            make_child=self._make_child,
        )
        self.muon, self.backup = halves_map["muon"], halves_map["backup"]  # type: ignore[assignment]
        self._mark_groups()
        self._record_sync(halves)

    def _owner_of(self, param: Any) -> torch.optim.Optimizer | None:
        """The half holding ``param`` (``None``: neither), from a table keyed by tensor identity that is rebuilt
        when a lookup misses (after ``add_param_group`` or an edit of a group's ``params`` list)."""
        entry = self.__dict__.get("_owners", {}).get(id(param))
        if entry is None or entry[1] is not param:
            self._sync()
            table = {id(p): (c, p) for c in self._children() for g in c.param_groups for p in g["params"]}
            self._owners = table
            entry = table.get(id(param))
        return None if entry is None else entry[0]

    def __getstate__(self) -> dict[str, Any]:
        """Pickle/deepcopy support: the two children (each pickles its own state and codebook), the list (the
        children's own dicts, so a copy shares them as the original does) and settings.

        Like ``torch.optim.Optimizer``, hooks and an LR scheduler's instance-level ``step`` wrapper are not
        pickled (they hold closures); the copy starts without them.
        """
        self._sync()
        skip = ("step", "_owners", "_synced")  # a scheduler's wrapper; caches rebuilt on use
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_optimizer_") and k not in skip}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        for name in _HOOK_REGISTRIES:
            self.__dict__.setdefault(name, OrderedDict())
        self.__dict__.setdefault("_skipped_steps", 0)
        self.__dict__.setdefault("_extra_state", defaultdict(dict))
        children = [c for c in (self.muon, self.backup) if c is not None]
        self.__dict__.setdefault("_groups", [g for c in children for g in c.param_groups])  # gefen before the list
        self.__dict__.setdefault("_named", all("param_names" in g for g in self._groups))
        self._mark_groups()
        self._record_sync()

    # ------------------------------------------------------------------ torch.optim surface
    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        """The param groups, a plain list in torch's order (see the class docstring); each dict is the one its half
        steps with."""
        return self._groups

    @param_groups.setter
    def param_groups(self, value: Any) -> None:
        """Replace the list (Lightning rebuilds the groups from saved metadata, then loads the optimizer's state):
        each new dict is routed to a half (its ``hybrid_half``, else the half holding its parameters, else the
        constructor's rule) and validated by that half before anything changes.

        Raises:
            TypeError, ValueError, ConfigError: a group cannot be placed; the hybrid keeps its former list.
        """
        groups = value if type(value) is list else list(value)
        before = self.__dict__.get("_groups")
        self._groups = groups
        try:
            self._sync()
        except BaseException:
            self._groups = before
            raise

    @property  # type: ignore[override]
    def state(self) -> _StateView:
        """Per-parameter state, routed to the owning child."""
        return _StateView(self)

    @state.setter
    def state(self, value: Any) -> None:
        raise TypeError("GefenMuonHybrid.state cannot be assigned; load a state_dict instead.")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Append a param group (``torch.optim`` semantics: it becomes ``param_groups[-1]``) to the half that owns it.

        The half is the group's ``"hybrid_half"`` entry (``"muon"`` or ``"backup"``) when given, else the
        constructor's rule (algorithm.md §8.1) applied to each parameter: 2-D and no backup substring in its name
        (from ``(name, tensor)`` pairs or ``param_names``; a bare tensor has no name) goes to Muon, the rest to the
        backup; a half the hybrid was built without is built for it, with the constructor's options. Bare tensors
        joining a hybrid whose parameters have names are named ``param_groups[i][j]`` (torch refuses such a group).

        Raises:
            TypeError: ``param_group`` is not a dict, or holds something that is not a tensor.
            ValueError: names on a hybrid without names (torch's rule), or on some parameters only.
            ConfigError: the rule sends the group's parameters to different halves (split the group or pass
                ``hybrid_half``), an unknown ``hybrid_half``, a parameter already in the hybrid, or whatever the
                half refuses (invalid hyperparameters, a non-2-D parameter for Muon, ...).
        """
        self._sync()
        index = len(self._groups)
        half, spec = group_spec(param_group, index, named=self._named, substrings=self._backup_substrings, owners={})
        where = f"GefenMuonHybrid param_groups[{index}]"
        pairs = [item if isinstance(item, tuple) else (None, item) for item in spec["params"]]
        labels = [param_label(where, i, name) for i, (name, _) in enumerate(pairs)]
        refuse_duplicates("hybrid", where, labels, [p for _, p in pairs], self._groups, self._named)
        child = self._halves()[half]
        if child is None:
            child = self._make_child(half, [spec])
            setattr(self, half, child)
        else:
            child.add_param_group(spec)
        publish(child.param_groups, len(child.param_groups) - 1, param_group)  # the caller's dict, as in torch
        self._groups.append(param_group)
        self._mark_groups()
        self._record_sync(self._group_halves + [half])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``torch.optim.Optimizer.zero_grad`` over :attr:`param_groups` (every parameter of the list, both halves',
        whether or not its group has joined its half yet)."""
        super().zero_grad(set_to_none=set_to_none)

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
        ``(loss, skip)`` (see :class:`gefen.optim._base.StepSkip`; ``None``: the step runs). New groups of the list
        join their halves first (a group that cannot is refused here, on every rank when sharded)."""
        self._sync()
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

    def state_bytes(self) -> int:
        """Persistent optimizer state of both halves in bytes, measured from the live tensors: each Gefen half's
        :meth:`gefen.Gefen.state_bytes` (its codebook included); a torch AdamW backup's per-parameter tensors
        (``exp_avg``, ``exp_avg_sq``, ``step``). Entries of :attr:`state` that are not parameters are not counted."""
        self._sync()
        return sum(half_state_bytes(child) for child in self._halves().values() if child is not None)

    def state_report(self) -> list[dict[str, Any]]:
        """Per-parameter report, in :attr:`param_groups` order, each parameter once.

        Returns:
            One dict per parameter with :meth:`gefen.Gefen.state_report`'s keys (``name``, ``shape``, ``numel``,
            ``period``, ``second_moment``, ``layout``, ``state_bytes``, ``backend``) and ``half`` (``"muon"`` or
            ``"backup"``). A torch AdamW backup's rows have ``period`` and ``layout`` ``None``,
            ``second_moment`` ``"elementwise (torch AdamW)"`` and ``backend`` ``"torch"`` once the parameter has
            state. The rows' ``state_bytes`` add up to :meth:`state_bytes` less the Gefen halves' codebooks.
        """
        self._sync()
        return hybrid_state_report(self._groups, self._halves())

    @property
    def skipped_steps(self) -> int:
        """Number of ``step()`` calls skipped (in both halves) because a gradient held NaN/Inf
        (``nonfinite="skip"``); saved in checkpoints."""
        return self._skipped_steps

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's layout over both halves (see :mod:`gefen.checkpoint_hybrid`): ``state`` keyed by position
        in :attr:`param_groups` order (torch's numbering), the groups in list order, each naming its half
        (``hybrid_half``) and carrying its half's metadata (``param_names`` only where the parameters have names),
        and the hybrid's own ``gefen_hybrid`` entry (backup optimizer, ``deterministic``, ``skipped_steps``). The
        DCP helpers take the hybrid itself.

        The hybrid's own state-dict pre-hooks run first and its post-hooks last (each child runs its own too).
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        self._sync()
        sd = build_hybrid_state_dict(
            [(half, g["params"]) for half, g in zip(self._group_halves, self._groups)],
            {half: child.state_dict() for half, child in self._halves().items() if child in self._children()},
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

        Accepts torch's layout (:meth:`state_dict`): schema 2 loads group by group in list order (the groups'
        halves must come in the live list's order), schema 1 (Muon groups first) half by half; and the gefen 0.1
        layout ``{"muon", "backup", "backup_optimizer"}``, which migrates (see
        :func:`gefen.checkpoint_hybrid.split_hybrid_state_dict`). As in torch, the live list keeps its order and
        takes new dicts; a group's saved ``param_names`` replace the live ones (a hybrid without names gets them).

        Raises:
            CheckpointError: not a hybrid checkpoint, another backup backend, a half present in one and missing in
                the other, groups in another order of halves, or a half that fails its own validation.
        """
        sd: Any = dict(state_dict) if isinstance(state_dict, Mapping) else state_dict
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            out = hook(self, sd)
            if out is not None:
                sd = out
        self._sync()
        live = hybrid_metadata(self.backup_optimizer, self.deterministic, self._skipped_steps)
        split = split_hybrid_state_dict(sd, self.backup_optimizer, self.deterministic, live, self._group_halves)
        halves = {"muon": split.muon, "backup": split.backup}
        children = {half: c if c in self._children() else None for half, c in self._halves().items()}
        for half, child in children.items():
            if (halves[half] is None) != (child is None):
                raise CheckpointError(f"the checkpoint's {half} half does not match this hybrid's (one is empty).")
        staged = [(child, _stage_half(child, halves[half], half)) for half, child in children.items() if child]
        skipped = split.skipped_steps
        extra: defaultdict[Any, Any] = defaultdict(dict, copy.deepcopy(split.extra_state))  # before the commit
        for child, half_state in staged:  # commit: plain assignments
            if isinstance(child, Gefen):
                child._publish_load(half_state)
            else:
                child.__setstate__({"state": half_state.state, "param_groups": half_state.param_groups})
        self._skipped_steps = skipped
        self._extra_state = extra
        ordinal = dict.fromkeys(HALVES, 0)  # the list keeps its order; each position takes its half's loaded group
        groups = []
        for half in self._group_halves:
            groups.append(children[half].param_groups[ordinal[half]])  # type: ignore[union-attr]
            ordinal[half] += 1
        self._groups = groups
        self._named = all("param_names" in g for g in groups)
        self._mark_groups()
        self._record_sync(list(self._group_halves))
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
