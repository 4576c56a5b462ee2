"""The optimizers ``gefen demo`` can run: name → factory, recommended lr, description.

This module owns how each optimizer is built for the demo (param groups, weight decay, betas, the
implementation flag) and how its state is measured in bytes. Training lives in ``demo.py``.

Shared policy, identical for every entry so the comparison is about the update rule only:

* **Weight decay** 0.1 (decoupled, ``p ← p·(1 − lr·0.1)``) on every parameter with ``ndim >= 2`` except
  embedding tables; 0 on the embedding, RMSNorm weights and any bias. Two param groups, built by
  :func:`param_groups`, passed as ``(name, tensor)`` pairs so optimizers that use names (Gefen) get them.
* **Betas** (0.9, 0.95) for the Adam-family entries (AdamW, Gefen), the usual choice for short LM runs.
  Adafactor (torch's implementation) has no first moment; it keeps its defaults.
* **Recommended lr**: the best eval loss of an lr sweep on the default demo run (``docs/lr_sweep.md``; the Muon
  hybrids: ``docs/muon_ablation.md``);
  every peer is tuned, none is a strawman. ``--lr NAME=VALUE`` overrides it.

Entries:

* ``adamw``: ``torch.optim.AdamW(fused=True)`` when the fused CPU kernel works in this torch build, else
  ``foreach=False`` (the single-tensor for-loop). Which one ran is in the description, never silent.
* ``adamw-foreach``: ``torch.optim.AdamW(foreach=True)`` (multi-tensor), same math.
* ``adafactor``: ``torch.optim.Adafactor`` (factored second moment, no momentum). Its ``lr`` is the cap
  on the *relative* step size ``rho_t = min(lr, 1/sqrt(t))``, scaled by each parameter's RMS, so its
  numbers are not comparable with AdamW's. Its decoupled decay is ``p ← p·(1 − lr·wd)`` with that larger
  lr, so the decayed group gets ``wd = 0.1 · lr_adamw / lr`` (``lr_adamw`` = AdamW's recommended lr): the
  per-step shrink then equals AdamW's, whatever Adafactor lr is chosen.
* ``gefen``: ``gefen.Gefen``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where it is used: `gefen --help` and the demo's parent start without it
    import torch
    from torch import nn

__all__ = [
    "BETAS",
    "OPTIMIZERS",
    "WEIGHT_DECAY",
    "OptimizerSpec",
    "describe",
    "param_groups",
    "state_bytes",
    "torch_muon_gemms_in_fp32",
]

WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.95)
_ADAMW_LR = 1e-3


@dataclass(frozen=True)
class OptimizerSpec:
    """One demo entry.

    Attributes:
        name: the ``--optimizers`` name.
        factory: ``factory(model, lr)`` returns a ready ``torch.optim.Optimizer`` over ``model``'s parameters,
            with :data:`WEIGHT_DECAY` applied by :func:`param_groups`.
        lr: recommended peak learning rate for the default demo run (see ``docs/lr_sweep.md``).
        description: one line: class, implementation flags, lr convention.
    """

    name: str
    factory: Callable[[nn.Module, float], torch.optim.Optimizer]
    lr: float
    description: str


def param_groups(model: nn.Module, weight_decay: float = WEIGHT_DECAY) -> list[dict[str, Any]]:
    """Split ``model``'s trainable parameters into a decayed and a non-decayed param group.

    Args:
        model: any module; embedding tables are found as ``nn.Embedding`` modules.
        weight_decay: decoupled weight-decay coefficient of the decayed group (dimensionless, >= 0).

    Returns:
        ``[{"params": [(name, p), ...], "weight_decay": weight_decay},
        {"params": [(name, p), ...], "weight_decay": 0.0}]``; the first holds every parameter with
        ``ndim >= 2`` that is not an embedding table, the second everything else. Empty groups are omitted.
    """
    from torch import nn

    embeddings = {
        f"{module_name}.{param_name}" if module_name else param_name
        for module_name, module in model.named_modules()
        if isinstance(module, nn.Embedding)
        for param_name, _ in module.named_parameters(recurse=False)
    }
    decay: list[tuple[str, nn.Parameter]] = []
    no_decay: list[tuple[str, nn.Parameter]] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (decay if param.ndim >= 2 and name not in embeddings else no_decay).append((name, param))
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


@functools.cache
def _fused_adamw_on_cpu() -> bool:
    """Whether this torch build runs ``AdamW(fused=True)`` on CPU.

    torch's own list of devices with fused kernels, the list ``AdamW(fused=True)`` checks its parameters
    against; it costs nothing, where building an optimizer imports ``torch._dynamo`` (1-2 s, paid again by each
    demo process). A torch without that (private) list is probed on a 1-element tensor instead.
    """
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:
        return _fused_adamw_probe()
    return "cpu" in _get_fused_kernels_supported_devices()


def _fused_adamw_probe() -> bool:
    """Whether one ``AdamW(fused=True)`` step on a 1-element CPU tensor runs."""
    import torch

    probe = torch.zeros(1, requires_grad=True)
    probe.grad = torch.ones(1)
    try:
        torch.optim.AdamW([probe], lr=1e-3, fused=True).step()
    except (RuntimeError, ValueError):
        return False
    return True


def _adamw(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    import torch

    if _fused_adamw_on_cpu():
        return torch.optim.AdamW(param_groups(model), lr=lr, betas=BETAS, fused=True)
    return torch.optim.AdamW(param_groups(model), lr=lr, betas=BETAS, foreach=False)


def _adamw_foreach(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    import torch

    return torch.optim.AdamW(param_groups(model), lr=lr, betas=BETAS, foreach=True)


def _adafactor_weight_decay(lr: float) -> float:
    return WEIGHT_DECAY * _ADAMW_LR / lr


def _adafactor(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    import torch

    # torch's Adafactor decays p <- p * (1 - lr * wd) with its own, much larger lr; scale wd so the
    # per-step shrink equals AdamW's at AdamW's recommended lr (see the module docstring).
    weight_decay = _adafactor_weight_decay(lr)
    return torch.optim.Adafactor(param_groups(model, weight_decay), lr=lr)


def _gefen(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    from gefen import Gefen

    return Gefen(param_groups(model), lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY)


def _gefen_eager(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    from gefen import Gefen

    return Gefen(param_groups(model), lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY, backend="eager")


#: Muon hybrids' peak lr (both halves; AdamW-scale thanks to ``adjust_lr_fn="match_rms_adamw"``): the best of
#: 3e-3/5e-3/8e-3/1.2e-2 for both hybrids in ``docs/muon_ablation.md`` (2 seeds).
_MUON_LR = 8e-3


def _gefen_muon_hybrid(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    from gefen import GefenMuonHybrid

    return GefenMuonHybrid(
        model, lr=lr, betas=BETAS, muon_weight_decay=WEIGHT_DECAY, backup_weight_decay=0.0, backup_optimizer="gefen"
    )


def torch_muon_gemms_in_fp32() -> bool:
    """Make ``torch.optim.Muon`` in this process run its Newton–Schulz products as fp32 GEMMs of bf16 operands
    where the CPU has no bf16 matrix instructions; return whether it did.

    torch's Newton–Schulz (``torch.optim._muon._zeropower_via_newtonschulz``) is the same iteration with the same
    grouping as :func:`gefen.math.newton_schulz.newton_schulz`; on a CPU without bf16 matrix instructions its bf16
    GEMMs fall back to a scalar loop (~15 s per demo step instead of ~0.2 s). There the module function is replaced
    by ours with ``(ns_coefficients,) * ns_steps``: the same values up to the order of fp32 sums. Nothing changes
    where bf16 GEMMs are native, or in a torch without that function. Called by the ``torch-muon-hybrid`` factory in
    the demo's training process (each optimizer trains in its own process) and by ``benchmarks/muon_ablation.py``.
    """
    import torch

    from gefen.math.newton_schulz import bf16_gemm_is_native, newton_schulz

    try:
        import torch.optim._muon as torch_muon
    except ImportError:  # a torch without torch.optim.Muon (before 2.9): nothing to route
        return False
    if bf16_gemm_is_native(torch.device("cpu")) or not hasattr(torch_muon, "_zeropower_via_newtonschulz"):
        return False

    def zeropower(grad: torch.Tensor, ns_coefficients: Any, ns_steps: int, eps: float) -> torch.Tensor:
        if grad.device.type != "cpu":
            return original(grad, ns_coefficients, ns_steps, eps)
        return newton_schulz(grad, (tuple(ns_coefficients),) * ns_steps, eps)

    original = getattr(torch_muon._zeropower_via_newtonschulz, "__wrapped__", torch_muon._zeropower_via_newtonschulz)
    zeropower.__wrapped__ = original  # type: ignore[attr-defined]
    torch_muon._zeropower_via_newtonschulz = zeropower
    return True


def _torch_muon_hybrid(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    import torch

    from gefen import split_params_for_muon
    from gefen.cli._pair import OptimizerPair

    torch_muon_gemms_in_fp32()
    muon, backup = split_params_for_muon(model)
    first = torch.optim.Muon(
        [p for _, p in muon],
        lr=lr,
        weight_decay=WEIGHT_DECAY,
        momentum=0.95,
        nesterov=True,
        adjust_lr_fn="match_rms_adamw",
    )
    second = torch.optim.AdamW([p for _, p in backup], lr=lr, betas=BETAS, weight_decay=0.0)
    return OptimizerPair(first, second)


def _adamw_description() -> str:
    flavour = "fused=True" if _fused_adamw_on_cpu() else "foreach=False (fused CPU kernel unavailable)"
    return f"torch.optim.AdamW({flavour}), betas={BETAS}"


def _registry() -> dict[str, OptimizerSpec]:
    entries = [
        OptimizerSpec("adamw", _adamw, _ADAMW_LR, "torch.optim.AdamW, fused=True on CPU when supported"),
        OptimizerSpec("adamw-foreach", _adamw_foreach, _ADAMW_LR, f"torch.optim.AdamW(foreach=True), betas={BETAS}"),
        OptimizerSpec("adafactor", _adafactor, 5e-2, "torch.optim.Adafactor; lr caps the relative step size"),
        OptimizerSpec(
            "gefen",
            _gefen,
            1e-3,
            f"gefen.Gefen (~1 byte/param of state; backend='auto': native on CPU where built), betas={BETAS}",
        ),
        OptimizerSpec(
            "gefen-eager", _gefen_eager, 1e-3, f"gefen.Gefen(backend='eager'): the torch reference step, betas={BETAS}"
        ),
        OptimizerSpec(
            "gefen-muon-hybrid",
            _gefen_muon_hybrid,
            _MUON_LR,
            "gefen.GefenMuonHybrid: GefenMuon (standard Newton–Schulz + NorMuon, match_rms_adamw) on 2-D hidden "
            "weights, "
            f"Gefen on the rest, betas={BETAS}",
        ),
        OptimizerSpec(
            "torch-muon-hybrid",
            _torch_muon_hybrid,
            _MUON_LR,
            "torch.optim.Muon (match_rms_adamw) on the same 2-D hidden weights + torch.optim.AdamW on the rest",
        ),
    ]
    return {entry.name: entry for entry in entries}


#: Every optimizer the demo knows, by ``--optimizers`` name.
OPTIMIZERS: dict[str, OptimizerSpec] = _registry()


def _cpu_step_backend() -> str:
    """The step the default (``backend="auto"``) Gefen optimizers run on the CPU here, from
    :func:`gefen.kernels.native_status`: the native library and its CPU level, or the eager step and why."""
    from gefen.kernels import native_status

    status = native_status()
    if status.available:
        return f"step backend here: native ({status.level})"
    return f"step backend here: eager (slower; same results), the native one is unavailable: {status.reason}"


def warm_up() -> None:
    """Load what building and stepping any demo optimizer loads: gefen's optimizers and ``torch._dynamo`` (building
    a ``torch.optim.Optimizer`` imports it), so that a demo process can do it before its training is timed."""
    import gefen.optim.hybrid  # noqa: F401  (Gefen, GefenMuon and GefenMuonHybrid)

    _fused_adamw_probe()


def describe(name: str, lr: float) -> str:
    """Return the one-line description of ``name`` run at peak ``lr``, with run-time facts (fused or not,
    Adafactor's scaled weight decay, the step backend the Gefen optimizers will run here)."""
    if name == "adamw":
        return _adamw_description()
    parts = [OPTIMIZERS[name].description]
    if name in ("gefen-muon-hybrid", "torch-muon-hybrid"):
        import torch

        from gefen.math.newton_schulz import bf16_gemm_is_native

        if not bf16_gemm_is_native(torch.device("cpu")):
            parts.append("Newton–Schulz GEMMs in fp32 on bf16 values (this CPU has no bf16 matrix instructions)")
    if name in ("gefen", "gefen-muon-hybrid"):
        parts.append(_cpu_step_backend())
    if name == "adafactor":
        weight_decay = _adafactor_weight_decay(lr)
        parts.append(f"weight_decay={weight_decay:.3g} (= 0.1 x {_ADAMW_LR:g} / lr)")
    return "; ".join(parts)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state.

    Args:
        optimizer: any optimizer after at least one step (state is created lazily).

    Returns:
        ``optimizer.state_bytes()`` when the optimizer defines it (Gefen: its own accounting, the single
        source of truth for its packed state); otherwise ``sum(t.numel() * t.element_size())`` over every
        tensor in ``optimizer.state`` values, including scalar ``step`` tensors. In bytes.
    """
    import torch

    own = getattr(optimizer, "state_bytes", None)
    if callable(own):
        return int(own())
    total = 0
    for per_param in optimizer.state.values():
        for value in per_param.values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total
