"""The demo model's hyperparameters and named sizes, without torch (the CLI's parsers list the sizes).

The model itself, :class:`gefen.cli._model.ByteTransformer`, is in ``_model.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MODEL_SIZES", "ModelConfig"]


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of :class:`ByteTransformer`.

    Attributes:
        d_model: residual-stream width.
        n_layers: number of transformer blocks.
        n_heads: attention heads; must divide ``d_model`` and give an even head size (for RoPE).
        d_ff: hidden width of the SwiGLU MLP.
        context_len: longest sequence the rotary tables cover, in tokens (bytes).
        vocab_size: number of token ids; 256 for bytes.
    """

    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    context_len: int = 128
    vocab_size: int = 256


#: Named sizes for ``--model-size``. Parameter counts (context 128): tiny ≈ 0.86M, small ≈ 3.3M.
MODEL_SIZES: dict[str, ModelConfig] = {
    "tiny": ModelConfig(d_model=128, n_layers=4, n_heads=4, d_ff=344),
    "small": ModelConfig(d_model=256, n_layers=4, n_heads=4, d_ff=688),
}
