"""Two torch optimizers stepped as one: the ``torch-muon-hybrid`` peer of the demo and the Muon benchmarks."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["OptimizerPair"]


class OptimizerPair(torch.optim.Optimizer):
    """``first`` and ``second`` as one ``torch.optim.Optimizer``: their param groups and state, concatenated in that
    order; ``step()`` and ``zero_grad()`` run both. Enough for the demo's LR scheduler, state accounting and
    training loop; ``state_dict()`` is not combined.

    Args:
        first: the optimizer of the first half (e.g. ``torch.optim.Muon`` over the 2-D hidden weights).
        second: the optimizer of the rest (e.g. ``torch.optim.AdamW``); its defaults are ignored.
    """

    def __init__(self, first: torch.optim.Optimizer, second: torch.optim.Optimizer) -> None:
        self.children = (first, second)
        self.defaults = first.defaults
        for hooks in ("step_pre", "step_post", "state_dict_pre", "state_dict_post", "load_state_dict_pre",
                      "load_state_dict_post"):  # fmt: skip
            setattr(self, f"_optimizer_{hooks}_hooks", {})
        self._zero_grad_profile_name = "Optimizer.zero_grad#OptimizerPair.zero_grad"
        self._patch_step_function()

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for child in self.children for g in child.param_groups]

    @property  # type: ignore[override]
    def state(self) -> dict[Any, Any]:
        return {k: v for child in self.children for k, v in child.state.items()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``zero_grad(set_to_none)`` of both optimizers."""
        for child in self.children:
            child.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Evaluate ``closure`` (if given) once, then step both optimizers; returns the closure's loss or ``None``."""
        loss = None if closure is None else closure()
        for child in self.children:
            child.step()
        return loss
