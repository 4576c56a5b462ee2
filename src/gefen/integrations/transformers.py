"""Hugging Face ``Trainer`` integration: ``Trainer(optimizer_cls_and_kwargs=...)`` and ``optim_args`` strings.

Owns the mapping from ``transformers.TrainingArguments`` to the constructor arguments of :class:`gefen.Gefen` and
:class:`gefen.GefenMuonHybrid`, the factory through which ``Trainer`` builds the hybrid on its own model, and the
parser of ``TrainingArguments.optim_args`` strings. Validation of the values, the step and checkpoints stay with
the optimizers (:mod:`gefen.optim`); Accelerate needs nothing from here (see the README's "Accelerate" section).

``transformers`` and ``accelerate`` are imported by :func:`optimizer_cls_and_kwargs` only, never at import time;
without them it raises an ``ImportError`` naming ``pip install gefen[hf]``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import re
import types
import typing
import warnings
from collections.abc import Sequence
from typing import Any

from torch import nn

from gefen.optim.gefen import Gefen
from gefen.optim.hybrid import GefenMuonHybrid

__all__ = [
    "OPTIMIZERS",
    "RECOMMENDED_LR_FACTORS",
    "GefenMuonHybridFactory",
    "TrainerGefen",
    "optimizer_cls_and_kwargs",
    "parse_optim_args",
]

#: Accepted ``optimizer`` names.
OPTIMIZERS = ("gefen", "gefen-muon-hybrid")

#: The README's "Recommended learning rate" rule, as a factor on the lr tuned for AdamW: Gefen's best lr equals
#: AdamW's in the sweep of docs/lr_sweep.md (both best at 1e-3, two seeds), and the hybrid runs at AdamW's lr
#: (``adjust_lr_fn="match_rms_adamw"`` rescales Muon's update to AdamW's RMS) until a sweep says otherwise.
RECOMMENDED_LR_FACTORS: dict[str, float] = {"gefen": 1.0, "gefen-muon-hybrid": 1.0}

_INSTALL_HINT = "pip install gefen[hf]"

#: The ``TrainingArguments`` fields read by :func:`optimizer_cls_and_kwargs`.
_ARG_FIELDS = ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon")

_BOOL_WORDS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
_INT_RE = re.compile(r"[+-]?\d+")
_CLOSERS = {"(": ")", "[": "]"}


def _constructor(optimizer: str) -> type:
    if not isinstance(optimizer, str) or optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is not supported; choose one of {', '.join(OPTIMIZERS)}.")
    return Gefen if optimizer == "gefen" else GefenMuonHybrid


@functools.cache
def _options(optimizer: str) -> dict[str, Any]:
    """``{keyword: type hint}`` of the constructor's keyword options (the parameters argument excluded)."""
    cls = _constructor(optimizer)
    hints = typing.get_type_hints(cls.__init__)
    params = list(inspect.signature(cls.__init__).parameters.values())[2:]  # self, params/model_or_named_params
    return {p.name: hints[p.name] for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _require_hf() -> None:
    for name in ("transformers", "accelerate"):
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise ImportError(
                f"gefen.integrations.transformers needs {name}, which cannot be imported ({err}); "
                f"install the Hugging Face extra: {_INSTALL_HINT}"
            ) from err


def _require_factory_protocol() -> None:
    """The hybrid needs ``Trainer``'s factory protocol: a non-``Optimizer`` class is instantiated and called with
    the model (``transformers.trainer_optimizer.is_optimizer_factory``)."""
    try:
        from transformers.trainer_optimizer import is_optimizer_factory
    except ImportError as err:
        import transformers

        raise ImportError(
            f"optimizer='gefen-muon-hybrid' needs Trainer's optimizer-factory protocol "
            f"(transformers.trainer_optimizer.is_optimizer_factory), which transformers {transformers.__version__} "
            "lacks: upgrade transformers, or build the optimizer yourself and pass "
            "Trainer(optimizers=(gefen.GefenMuonHybrid(model, lr=...), None))."
        ) from err
    if not is_optimizer_factory(GefenMuonHybridFactory):  # pragma: no cover - a protocol change in transformers
        raise ImportError("this transformers does not treat GefenMuonHybridFactory as an optimizer factory.")


def _check_overrides(optimizer: str, overrides: dict[str, Any]) -> None:
    valid = _options(optimizer)
    unknown = sorted(k for k in overrides if k not in valid)
    if unknown:
        raise TypeError(
            f"optimizer_cls_and_kwargs got {', '.join(map(repr, unknown))}, not an option of "
            f"{_constructor(optimizer).__name__}; valid options: {', '.join(valid)}."
        )
    if optimizer == "gefen" and "weight_decay" in overrides:
        raise ValueError(
            "optimizer_cls_and_kwargs(optimizer='gefen') cannot take weight_decay: Trainer gives Gefen two param "
            "groups, one with weight_decay=TrainingArguments.weight_decay and one (biases, norms) with 0.0, and a "
            "group's value replaces the optimizer's; set TrainingArguments(weight_decay=...) instead."
        )


def _read_args(training_args: Any) -> dict[str, Any]:
    missing = [f for f in _ARG_FIELDS if not hasattr(training_args, f)]
    if missing:
        raise TypeError(
            f"optimizer_cls_and_kwargs needs transformers.TrainingArguments; {type(training_args).__name__} has no "
            f"{', '.join(missing)}."
        )
    return {f: getattr(training_args, f) for f in _ARG_FIELDS}


def _dry_run(optimizer: str, kwargs: dict[str, Any], model: nn.Module | None) -> None:
    """Build the optimizer once on ``model`` (or a tiny stand-in) so bad values fail here, not inside
    ``Trainer.train()``; construction allocates no state. Warnings wait for the real construction."""
    probe = model if model is not None else nn.Linear(2, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if optimizer == "gefen":
            TrainerGefen([{"params": list(probe.parameters())}, {"params": []}], **kwargs)
        else:
            GefenMuonHybrid(probe, **kwargs)


class TrainerGefen(Gefen):
    """:class:`gefen.Gefen` as ``Trainer`` builds it: the same optimizer, minus Trainer's empty param group.

    ``Trainer`` always passes two param groups, the decayed parameters and the rest (biases, norm weights); one
    is empty when every trainable parameter falls on one side (a model without biases or norms, or BitFit-style
    tuning of biases only). ``torch.optim.AdamW`` keeps an empty group, and so does Gefen since gefen accepts
    empty groups as torch does; this class still drops it, so that checkpoints of runs it built (one group) keep
    loading. Everything else (arguments, errors, state, checkpoints, ``kind == "Gefen"``) is :class:`gefen.Gefen`'s,
    and a checkpoint saved by one loads into the other.

    Args:
        params: what ``Trainer`` passes, a list of param-group dicts (anything else goes to Gefen unchanged).
        **kwargs: :class:`gefen.Gefen` keyword arguments.

    Raises:
        ConfigError, TypeError: as :class:`gefen.Gefen` (e.g. no trainable parameter at all).
    """

    def __init__(self, params: Any, **kwargs: Any) -> None:
        if isinstance(params, list) and any(isinstance(g, dict) for g in params):
            kept = [
                g for g in params if not (isinstance(g, dict) and isinstance(g.get("params"), list) and not g["params"])
            ]
            params = kept or params  # all empty: Gefen keeps them, as AdamW does
        super().__init__(params, **kwargs)


class GefenMuonHybridFactory:
    """The optimizer "class" :func:`optimizer_cls_and_kwargs` returns for ``optimizer="gefen-muon-hybrid"``.

    ``Trainer.create_optimizer`` instantiates a class that is not a ``torch.optim.Optimizer`` with no arguments
    and calls the instance with its model and the kwargs (transformers' optimizer-factory protocol), so the
    hybrid routes the model it actually trains (by module type and parameter name), also when ``model_init``
    builds a new model. Outside ``Trainer``: ``cls, kwargs = optimizer_cls_and_kwargs(...);
    optimizer = cls()(model, **kwargs)``.
    """

    def __call__(self, model: nn.Module, *, expected_model: nn.Module | None = None, **kwargs: Any) -> GefenMuonHybrid:
        """Build ``GefenMuonHybrid(model, **kwargs)``.

        Args:
            model: the module to train (``Trainer.model``); its trainable parameters are routed by
                :func:`gefen.split_params_for_muon`.
            expected_model: the ``model=`` given to :func:`optimizer_cls_and_kwargs`, if any; ``model`` must be
                that very object.
            **kwargs: :class:`gefen.GefenMuonHybrid` keyword arguments.

        Returns:
            The hybrid optimizer.

        Raises:
            TypeError: ``model`` is not an ``nn.Module``.
            ValueError: ``model`` is not ``expected_model``.
            ConfigError: invalid hybrid arguments (see :class:`gefen.GefenMuonHybrid`).
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"GefenMuonHybridFactory needs the nn.Module to train, got {type(model).__name__}.")
        if expected_model is not None and model is not expected_model:
            raise ValueError(
                f"GefenMuonHybridFactory was given model= {type(expected_model).__name__} (id {id(expected_model)}) "
                f"but is building the optimizer for another model, {type(model).__name__} (id {id(model)}): pass "
                "Trainer the same model, or drop model= (Trainer hands the factory its own model)."
            )
        return GefenMuonHybrid(model, **kwargs)


def optimizer_cls_and_kwargs(
    training_args: Any,
    optimizer: str = "gefen",
    *,
    model: nn.Module | None = None,
    recommended_lr: bool = False,
    **overrides: Any,
) -> tuple[type, dict[str, Any]]:
    """The ``(optimizer class, kwargs)`` pair for ``transformers.Trainer(optimizer_cls_and_kwargs=...)``.

    Mapping from ``TrainingArguments`` (then ``overrides`` replace any of these):

    * ``optimizer="gefen"`` returns ``(TrainerGefen, {"lr": learning_rate, "betas": (adam_beta1, adam_beta2),
      "eps": adam_epsilon})``. Trainer passes its usual two param groups (weight decay
      ``TrainingArguments.weight_decay`` on the decayed group, 0.0 on biases and norm weights, exactly as for
      AdamW; :class:`TrainerGefen` is :class:`gefen.Gefen` that drops the group when it is empty), so
      ``weight_decay`` is set in ``TrainingArguments``, not in ``overrides``. Parameters carry no names on this
      route (messages say ``param_groups[g][i]``).
    * ``optimizer="gefen-muon-hybrid"`` returns ``(GefenMuonHybridFactory, kwargs)``: Trainer calls the factory
      with its model, which builds ``GefenMuonHybrid(model, **kwargs)`` (routing needs the module; needs a
      transformers with the optimizer-factory protocol, 5.x). ``lr`` is Muon's lr and, by default, the backup's
      (``backup_lr=None``); ``betas``/``eps`` go to the backup (Gefen or AdamW), the only Adam in the hybrid
      (Muon's ``momentum`` and ``eps`` keep their own defaults); ``weight_decay`` (Muon's: the 2-D hidden weights)
      is ``TrainingArguments.weight_decay`` and ``backup_weight_decay=0.0``, because the backup holds the biases
      and norm weights Trainer never decays (plus embeddings and heads; pass ``backup_weight_decay=`` to decay
      them all).

    ``TrainingArguments.optim_args`` is not read: pass ``**parse_optim_args(args.optim_args)`` as overrides.
    The arguments are checked by building the optimizer once on ``model`` (or on a 2x2 stand-in), so bad values
    fail here rather than inside ``Trainer.train()``.

    Args:
        training_args: a ``transformers.TrainingArguments`` (any object with ``learning_rate``,
            ``weight_decay``, ``adam_beta1``, ``adam_beta2``, ``adam_epsilon``).
        optimizer: ``"gefen"`` or ``"gefen-muon-hybrid"``.
        model: only for the hybrid, optional: the model you give ``Trainer``; the factory then refuses to build
            for any other module (a stale model, e.g. with ``model_init``).
        recommended_lr: when True, ``lr = RECOMMENDED_LR_FACTORS[optimizer] * training_args.learning_rate``,
            taking ``learning_rate`` as the lr you tuned for AdamW. The rule (README, "Recommended learning
            rate"): keep AdamW's lr, factor 1.0 for both optimizers today, so the flag changes no value yet; it
            follows the table if a sweep changes it. When False (default), ``lr = learning_rate``.
        **overrides: constructor keyword arguments (e.g. ``fused=False, deterministic=True``) that replace the
            mapped values; :func:`parse_optim_args` produces them from an ``optim_args`` string.

    Returns:
        ``(cls, kwargs)``: :class:`TrainerGefen` or :class:`GefenMuonHybridFactory`, and a new dict of keyword
        arguments (for the hybrid with ``model=``, it also holds ``expected_model``, read by the factory).

    Raises:
        ValueError: an unknown ``optimizer`` (the choices listed); ``weight_decay`` among the overrides for
            ``"gefen"``; ``model=`` with ``"gefen"``; ``lr`` among the overrides with ``recommended_lr=True``.
        TypeError: an override that is not an option of the constructor (the valid ones listed); a
            ``training_args`` without the fields above; ``model`` not an ``nn.Module``; a non-bool
            ``recommended_lr``.
        ImportError: transformers or accelerate missing (``pip install gefen[hf]``), or a transformers without the
            optimizer-factory protocol for the hybrid.
        gefen.ConfigError: a value the optimizer refuses (e.g. ``adam_beta2=1.0``), from the check build.

    Example:
        >>> from transformers import TrainingArguments
        >>> from gefen.integrations.transformers import optimizer_cls_and_kwargs, parse_optim_args
        >>> args = TrainingArguments("out", learning_rate=3e-4, adam_beta2=0.95, optim_args="fused=false",
        ...                          report_to=[], use_cpu=True)
        >>> cls, kwargs = optimizer_cls_and_kwargs(args, **parse_optim_args(args.optim_args))
        >>> cls.__name__, kwargs["lr"], kwargs["betas"], kwargs["fused"]
        ('TrainerGefen', 0.0003, (0.9, 0.95), False)
    """
    _constructor(optimizer)
    if not isinstance(recommended_lr, bool):
        raise TypeError(f"recommended_lr={recommended_lr!r} must be a bool.")
    _require_hf()
    _check_overrides(optimizer, overrides)
    if model is not None and optimizer == "gefen":
        raise ValueError(
            "optimizer_cls_and_kwargs(optimizer='gefen') takes no model=: Trainer passes Gefen its own param "
            "groups. model= is for optimizer='gefen-muon-hybrid'."
        )
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"model= must be the nn.Module given to Trainer, got {type(model).__name__}.")
    args = _read_args(training_args)
    lr = args["learning_rate"]
    if recommended_lr:
        if "lr" in overrides:
            raise ValueError("pass either lr= or recommended_lr=True, not both (recommended_lr sets lr).")
        lr = RECOMMENDED_LR_FACTORS[optimizer] * lr
    kwargs: dict[str, Any] = {"lr": lr, "betas": (args["adam_beta1"], args["adam_beta2"]), "eps": args["adam_epsilon"]}
    if optimizer == "gefen":
        kwargs.update(overrides)
        _dry_run(optimizer, kwargs, None)
        return TrainerGefen, kwargs
    kwargs["weight_decay"] = args["weight_decay"]
    kwargs["backup_weight_decay"] = 0.0
    kwargs.update(overrides)
    _require_factory_protocol()
    _dry_run(optimizer, kwargs, model)
    if model is not None:
        kwargs["expected_model"] = model
    return GefenMuonHybridFactory, kwargs


# ---------------------------------------------------------------------------------------------- optim_args


def _split_top_level(text: str, where: str) -> list[str]:
    """Split at commas outside brackets; refuse unbalanced or mismatched brackets."""
    pieces, depth, start = [], [], 0
    for i, ch in enumerate(text):
        if ch in _CLOSERS:
            depth.append(_CLOSERS[ch])
        elif ch in ")]":
            if not depth or depth.pop() != ch:
                raise ValueError(f"{where}: unbalanced {ch!r} at position {i}; brackets are ( ) or [ ], balanced.")
        elif ch == "," and not depth:
            pieces.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"{where}: a bracket is not closed (expected {depth[-1]!r}).")
    pieces.append(text[start:])
    return pieces


def _parse_value(raw: str, where: str) -> str | tuple[Any, ...]:
    """A value as a word (str, quotes stripped) or a bracketed tuple of values."""
    raw = raw.strip()
    if raw[:1] in _CLOSERS:
        if raw[-1:] != _CLOSERS[raw[0]]:
            raise ValueError(f"{where}: {raw!r} must end with {_CLOSERS[raw[0]]!r}.")
        inner = raw[1:-1]
        if not inner.strip():
            return ()
        items = _split_top_level(inner, where)
        if any(not item.strip() for item in items):
            raise ValueError(f"{where}: {raw!r} has an empty element.")
        return tuple(_parse_value(item, where) for item in items)
    if any(ch in raw for ch in "()[]"):
        raise ValueError(f"{where}: {raw!r} has a bracket inside a word.")
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
        raw = raw[1:-1]
    return raw


class _NoMatch(Exception):
    """A parsed value does not fit a type hint."""


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _coerce(node: str | tuple[Any, ...], hint: Any) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if _is_union(hint):
        if type(None) in args and isinstance(node, str) and node.lower() == "none":
            return None
        for arm in sorted((a for a in args if a is not type(None)), key=lambda a: a is str):  # str accepts any word
            try:
                return _coerce(node, arm)
            except _NoMatch:
                continue
        raise _NoMatch
    if origin is tuple or origin is Sequence or hint is tuple:
        if not isinstance(node, tuple):
            raise _NoMatch
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(node) != len(args):
                raise _NoMatch
            return tuple(_coerce(item, arm) for item, arm in zip(node, args))
        element = args[0] if args else str
        return tuple(_coerce(item, element) for item in node)
    if not isinstance(node, str):
        raise _NoMatch
    if hint is bool:
        if node.lower() in _BOOL_WORDS:
            return _BOOL_WORDS[node.lower()]
        raise _NoMatch
    if hint is int:
        if _INT_RE.fullmatch(node):
            return int(node)
        raise _NoMatch
    if hint is float:
        try:
            value = float(node)
        except ValueError:
            raise _NoMatch from None
        if not math.isfinite(value):
            raise _NoMatch
        return value
    if hint is str:
        if node:
            return node
        raise _NoMatch
    raise _NoMatch  # e.g. a Tensor arm: not writable as text


def _describe(hint: Any) -> str:
    """What a type hint accepts, in the words of the optim_args syntax."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if _is_union(hint):
        arms = [_describe(a) for a in args if a is not type(None)]
        arms = [a for a in arms if a]
        if type(None) in args:
            arms.append("none")
        return " or ".join(arms)
    if origin is tuple and args and args[-1] is not Ellipsis:
        return f"a bracketed tuple of {len(args)} ({', '.join(_describe(a) for a in args)}), e.g. (0.9,0.95)"
    if origin is tuple or origin is Sequence:
        return f"a bracketed tuple of any length, each element {_describe(args[0] if args else str)}"
    return {
        bool: "true/false/1/0/yes/no (any case)",
        int: "an integer",
        float: "a finite number",
        str: "a word",
    }.get(hint, "")


def parse_optim_args(text: str | None, optimizer: str = "gefen") -> dict[str, Any]:
    """Parse a ``TrainingArguments.optim_args`` string into constructor keyword arguments.

    The format is Trainer's: comma-separated ``key=value`` pairs, spaces around keys and values ignored, e.g.
    ``"fused=false, deterministic=true, betas=(0.9,0.95), nonfinite=raise"``. Keys are the keyword options of
    ``gefen.Gefen`` (``optimizer="gefen"``) or ``gefen.GefenMuonHybrid`` (``"gefen-muon-hybrid"``), and each value
    is converted to the type in the constructor's signature:

    * bool: ``true/false/yes/no/1/0`` (any case) only;
    * ``none`` (any case) where the option accepts ``None`` (e.g. ``fused=none``, ``backup_lr=none``);
    * int: decimal digits (``ns_steps=3``); float: any finite Python float literal (``lr=3e-4``);
    * tuples in brackets, elements separated by commas: ``betas=(0.9,0.95)``,
      ``ns_schedule=((3.4,-4.7,2.0),(3.0,-3.2,1.2))``, ``backup_substrings=(embed,lm_head)``;
    * strings as plain words, optionally quoted (``nonfinite=raise``); which words an option accepts is checked
      by the constructor (:func:`optimizer_cls_and_kwargs` builds it once).

    The result is ready for ``optimizer_cls_and_kwargs(args, optimizer, **parse_optim_args(...))``.

    Args:
        text: the ``optim_args`` string; ``None`` or blank gives ``{}``.
        optimizer: ``"gefen"`` or ``"gefen-muon-hybrid"``, whose constructor defines the keys and types.

    Returns:
        ``{key: value}`` in the order given, values typed as above.

    Raises:
        ValueError: an unknown ``optimizer``; a malformed pair (no ``=``, empty key or value, unbalanced
            brackets, an empty element); an unknown key (the valid ones listed); a key given twice; a value of
            the wrong kind, e.g. ``fused=maybe`` (the message names key, value and what the key accepts).
        TypeError: ``text`` is not a string.

    Example:
        >>> parse_optim_args("fused=False, deterministic=yes, betas=(0.9,0.95), nonfinite=none")
        {'fused': False, 'deterministic': True, 'betas': (0.9, 0.95), 'nonfinite': None}
    """
    _constructor(optimizer)
    options = _options(optimizer)
    if text is None:
        return {}
    if not isinstance(text, str):
        raise TypeError(f"parse_optim_args needs a string, got {type(text).__name__}.")
    if not text.strip():
        return {}
    where = f"optim_args {text!r}"
    result: dict[str, Any] = {}
    raw_values: dict[str, str] = {}
    for piece in _split_top_level(text, where):
        key, sep, raw = piece.partition("=")
        key, raw = key.strip(), raw.strip()
        if not sep or not key or not raw:
            raise ValueError(
                f"{where}: malformed pair {piece.strip()!r}; write key=value pairs separated by commas, e.g. "
                "'fused=false,deterministic=true'."
            )
        if key not in options:
            raise ValueError(
                f"{where}: unknown option {key!r} for {_constructor(optimizer).__name__}; valid options: "
                f"{', '.join(options)}."
            )
        if key in result:
            raise ValueError(f"{where}: {key!r} is given twice ({raw_values[key]!r} and {raw!r}); give it once.")
        try:
            result[key] = _coerce(_parse_value(raw, where), options[key])
        except _NoMatch:
            raise ValueError(
                f"{where}: {key}={raw!r} is not accepted; {key} takes {_describe(options[key])}."
            ) from None
        raw_values[key] = raw
    return result
