"""The optimizers ``gefen capacity`` compares: the demo's AdamW, Gefen and GefenMuonHybrid entries (same
param groups, betas and weight decay: :mod:`gefen.cli._optimizers`) plus, where installed, the 8-bit AdamW of
torchao and of bitsandbytes (block-wise 8-bit moments, ~2 bytes/param of state, Dettmers et al. 2022).

Each entry carries a prior: the peak bytes per parameter expected before measurements say more (fp32 weights and
gradients 8 B/param, plus the state: AdamW 8, the 8-bit AdamWs ~2, Gefen ~1, plus about one more for activations
and temporaries at small token counts). It only chooses the first model to try; every reported figure is measured.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gefen.cli._optimizers import BETAS, OPTIMIZERS, WEIGHT_DECAY, OptimizerSpec, param_groups

if TYPE_CHECKING:
    from torch import nn

__all__ = ["CAPACITY_OPTIMIZERS", "CapacityOptimizer", "available", "default_names"]


@dataclass(frozen=True)
class CapacityOptimizer:
    """One optimizer of ``gefen capacity``.

    Attributes:
        name: its ``--optimizers`` name.
        factory: ``factory(model, lr)`` → optimizer over ``model``'s parameters.
        lr: the learning rate of its runs.
        description: one line.
        prior_bytes_per_param: expected peak bytes per parameter (chooses the first model tried only).
        requires: the module that must be importable (``None``: always available).
    """

    name: str
    factory: Any
    lr: float
    description: str
    prior_bytes_per_param: float
    requires: str | None = None


def _torchao_adamw8bit(model: nn.Module, lr: float) -> Any:
    try:
        from torchao.optim import AdamW8bit
    except ImportError:  # torchao before 0.11 kept it under prototype
        from torchao.prototype.low_bit_optim import AdamW8bit  # type: ignore[no-redef]
    return AdamW8bit(param_groups(model), lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY)


def _bnb_adamw8bit(model: nn.Module, lr: float) -> Any:
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(param_groups(model), lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY)


def _from_demo(spec: OptimizerSpec, prior: float) -> CapacityOptimizer:
    return CapacityOptimizer(spec.name, spec.factory, spec.lr, spec.description, prior)


#: Every optimizer ``gefen capacity`` knows, by name (the 8-bit peers only run where their package imports).
CAPACITY_OPTIMIZERS: dict[str, CapacityOptimizer] = {
    "adamw": _from_demo(OPTIMIZERS["adamw"], 17.0),
    "gefen": _from_demo(OPTIMIZERS["gefen"], 10.0),
    "gefen-muon-hybrid": _from_demo(OPTIMIZERS["gefen-muon-hybrid"], 10.5),
    "torchao-adamw8bit": CapacityOptimizer(
        "torchao-adamw8bit", _torchao_adamw8bit, 1e-3, "torchao AdamW8bit (block-wise 8-bit moments)", 11.0, "torchao"
    ),
    "bnb-adamw8bit": CapacityOptimizer(
        "bnb-adamw8bit",
        _bnb_adamw8bit,
        1e-3,
        "bitsandbytes AdamW8bit (block-wise 8-bit moments)",
        11.0,
        "bitsandbytes",
    ),  # fmt: skip
}


def available(name: str) -> bool:
    """Whether optimizer ``name``'s package is installed (the built-in ones always are)."""
    requires = CAPACITY_OPTIMIZERS[name].requires
    return requires is None or importlib.util.find_spec(requires) is not None


def default_names() -> list[str]:
    """The default comparison: ``adamw``, ``gefen``, ``gefen-muon-hybrid`` and each installed 8-bit peer."""
    return [name for name in CAPACITY_OPTIMIZERS if available(name)]
