"""Which parameters of a model a :class:`gefen.GefenMuonHybrid` puts on Muon and which on its backup.

Routing (algorithm.md §8.1): a parameter goes to Muon iff it is 2-D, is not the weight of an
``nn.Embedding``/``nn.EmbeddingBag`` (matched by tensor identity, so a head tied to the embedding is caught) and its
lower-cased name contains none of the backup substrings; everything else (embeddings, heads, norms, biases, 0-D
and N-D tensors) goes to the backup.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import Tensor, nn

from gefen.errors import ConfigError

__all__ = [
    "DEFAULT_BACKUP_SUBSTRINGS",
    "BACKUP_OPTIMIZERS",
    "Named",
    "goes_to_muon",
    "nothing_for_muon",
    "split_params_for_muon",
    "validate_split",
]

#: Name fragments (lower case) that send a 2-D parameter to the backup (algorithm.md §8.1).
DEFAULT_BACKUP_SUBSTRINGS = ("embed", "wte", "wpe", "lm_head", "classifier", "score")

#: Accepted ``backup_optimizer`` values.
BACKUP_OPTIMIZERS = ("gefen", "adamw")

Named = list[tuple[str, Tensor]]


def goes_to_muon(name: str, param: Tensor, embedding_ids: set[int], substrings: Sequence[str]) -> bool:
    """The routing rule for one parameter: 2-D, not an embedding weight, no backup substring in its name.

    Args:
        name: the parameter's name (matched lower-cased).
        param: the tensor (any shape and dtype).
        embedding_ids: ``id()`` of the model's ``nn.Embedding``/``nn.EmbeddingBag`` weights.
        substrings: lower-case name fragments that send a parameter to the backup.

    Source: algorithm.md §8.1.
    """
    lowered = name.lower()
    return param.dim() == 2 and id(param) not in embedding_ids and not any(s in lowered for s in substrings)


def nothing_for_muon(muon: Named, backup: Named, substrings: Sequence[str], backup_optimizer: str) -> str | None:
    """The warning for a hybrid whose Muon half holds no element, or ``None`` when Muon has work.

    A user who asks for a Muon hybrid and silently gets a plain backup optimizer (weights flattened to 1-D by a
    wrapper, zero-element weights, embeddings only, or a ``backup_substrings`` that matches every weight) is told
    so, with the reason that applies to their parameters.

    Args:
        muon, backup: the split, lists of ``(name, parameter)``.
        substrings: the ``backup_substrings`` in force.
        backup_optimizer: ``"gefen"`` or ``"adamw"``.

    Returns:
        The message, or ``None``.
    """
    if any(p.numel() for _, p in muon):
        return None
    reasons = []
    flat = [(n, p) for n, p in backup if p.dim() < 2 and p.numel() >= 64]
    if flat:
        name, param = max(flat, key=lambda item: item[1].numel())
        reasons.append(
            f"{len(flat)} parameter(s) are 1-D with many elements (largest: {name!r}, {param.numel()} elements): "
            "weights flattened by a wrapper (e.g. FSDP1 flat parameters)? Build the hybrid on the unwrapped model"
        )
    empty = [n for n, p in muon + backup if p.dim() == 2 and p.numel() == 0]
    if empty:
        reasons.append(f"{len(empty)} 2-D weight(s) have no elements (e.g. {empty[0]!r})")
    routed = [n for n, p in backup if p.dim() == 2 and p.numel()]
    if routed:
        reasons.append(
            f"{len(routed)} 2-D weight(s) are embeddings or match backup_substrings={tuple(substrings)!r} "
            f"(e.g. {routed[0]!r})"
        )
    if not reasons:
        reasons.append("no parameter is a 2-D weight")
    return (
        "GefenMuonHybrid: no parameter qualifies for Muon (it takes 2-D hidden weights that have at least one "
        f"element), so all {len(backup)} parameter(s) go to the backup and this is a plain {backup_optimizer} "
        "optimizer: " + "; ".join(reasons) + ". Use gefen.Gefen directly if that is intended."
    )


def split_params_for_muon(
    model_or_named: nn.Module | Iterable[tuple[str, Tensor]],
    backup_substrings: Sequence[str] = DEFAULT_BACKUP_SUBSTRINGS,
) -> tuple[Named, Named]:
    """Split trainable parameters into the Muon half and the backup half.

    Args:
        model_or_named: an ``nn.Module`` (module-type aware: embedding weights are caught by identity, so a tied
            head is too) or an iterable of ``(name, parameter)`` pairs (name and ``ndim`` only).
        backup_substrings: lower-case name fragments that force the backup.

    Returns:
        ``(muon, backup)``: lists of ``(name, parameter)``, in ``named_parameters`` order. Frozen parameters
        (``requires_grad=False``) are routed like the others: as in ``torch.optim``, an optimizer holds every
        tensor it is given and updates it once it has a gradient (gradual unfreezing).

    Raises:
        TypeError: bare tensors instead of ``(name, tensor)`` pairs.

    Source: algorithm.md §8.1.
    """
    substrings = tuple(s.lower() for s in backup_substrings)
    if isinstance(model_or_named, nn.Module):
        embedding_ids = {
            id(m.weight) for m in model_or_named.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))
        }
        named = list(model_or_named.named_parameters())
    else:
        embedding_ids = set()
        named = list(model_or_named)
        for item in named:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise TypeError(
                    "split_params_for_muon needs an nn.Module or (name, tensor) pairs, e.g. "
                    f"model.named_parameters(); got {type(item).__name__}."
                )
    muon, backup = [], []
    for name, param in named:
        (muon if goes_to_muon(name, param, embedding_ids, substrings) else backup).append((name, param))
    return muon, backup


def validate_split(muon: Named, backup: Named, model: nn.Module | None = None) -> None:
    """Check a Muon/backup split: every trainable parameter in exactly one half, names unique.

    Args:
        muon, backup: lists of ``(name, tensor)``.
        model: when given, every trainable parameter of it must be covered.

    Raises:
        TypeError: an item is not a ``(str, Tensor)`` pair.
        ConfigError: a parameter twice in one list or in both (a ValueError).
        ValueError: names not unique (case-insensitive), or a
            trainable parameter of ``model`` missing.

    Source: algorithm.md §8.1.
    """
    seen: dict[int, tuple[str, str]] = {}  # id(tensor) -> (its first name, its half)
    names: dict[str, str] = {}
    for half, items in (("muon", muon), ("backup", backup)):
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise TypeError(f"{half} items must be (name, tensor) pairs, got {item!r:.80}")
            name, param = item
            if not isinstance(param, Tensor):
                raise TypeError(f"{half} item {name!r} holds a {type(param).__name__}, not a tensor")
            if id(param) in seen:
                first, where = seen[id(param)]
                halves = f"both in the {half} half" if where == half else f"one in the {where} half, one in the {half}"
                raise ConfigError(
                    f"GefenMuonHybrid: parameter {name!r} is the same tensor as {first!r} ({halves}): the same "
                    "parameter is listed twice; pass each parameter once."
                )
            seen[id(param)] = (name, half)
            key = name.lower()
            if key in names:
                raise ValueError(f"parameter name {name!r} is not unique (also {names[key]!r}, case-insensitive)")
            names[key] = name
    if model is not None:
        missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
        if missing:
            raise ValueError(f"trainable parameters in neither half: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
