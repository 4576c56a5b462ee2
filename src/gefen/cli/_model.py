"""The small byte-level transformer that ``gefen demo`` trains.

This module owns the model only: architecture, initialisation and the named sizes. Data lives in
``_data.py``, optimizers in ``_optimizers.py``, orchestration in ``demo.py``.

Architecture (decoder-only, pre-norm, the Llama recipe at toy scale):

* vocabulary of 256 byte values, token embedding ``(256, d_model)``;
* rotary position embeddings (RoPE, base 10000) applied to queries and keys, so positions carry no
  parameters and the model runs on any ``seq_len <= context_len``;
* ``n_layers`` blocks of ``x + attn(rmsnorm(x))`` then ``x + swiglu(rmsnorm(x))``; attention has
  separate q/k/v/o projections without bias and uses ``F.scaled_dot_product_attention(is_causal=True)``;
* final RMSNorm and an **untied** output head ``(256, d_model)``. Untied, because a tied matrix would
  need one weight-decay decision for two roles (embedding: no decay, head: decay), and every optimizer
  in the demo should see the same simple parameter partition.

Initialisation: every linear and the embedding ~ N(0, 0.02²); the two residual-output projections
(``attn.o_proj``, ``mlp.down_proj``) are scaled by ``1/sqrt(2·n_layers)`` (GPT-2). RMSNorm weights are 1.
The initial loss is therefore close to ``ln(256) ≈ 5.545`` nats/byte.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gefen.cli._model_config import MODEL_SIZES, ModelConfig

__all__ = ["MODEL_SIZES", "ByteTransformer", "ModelConfig", "build_model"]


def _rotary_tables(context_len: int, head_dim: int, base: float = 10000.0) -> tuple[Tensor, Tensor]:
    """Return ``(cos, sin)``, each ``(context_len, head_dim // 2)`` float32, for rotary embeddings."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(context_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def _apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs ``(x[..., :h/2], x[..., h/2:])`` of ``x`` (batch, heads, seq, head_dim) by position."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class _Attention(nn.Module):
    """Causal multi-head self-attention with RoPE and q/k/v/o projections (no bias)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.d_model // config.n_heads
        self.q_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.k_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.v_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.o_proj = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        batch, seq, width = x.shape
        shape = (batch, seq, self.n_heads, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(batch, seq, width))


class _SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` (Shazeer 2020), no bias."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.up_proj = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.down_proj = nn.Linear(config.d_ff, config.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.d_model)
        self.attn = _Attention(config)
        self.mlp_norm = nn.RMSNorm(config.d_model)
        self.mlp = _SwiGLU(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class ByteTransformer(nn.Module):
    """Decoder-only byte-level language model (see the module docstring for the architecture).

    Args:
        config: sizes; ``d_model % n_heads == 0`` and the head size must be even.

    Raises:
        ValueError: ``d_model`` is not divisible by ``n_heads`` or the head size is odd.

    Example:
        >>> model = ByteTransformer(MODEL_SIZES["tiny"])
        >>> model(torch.zeros(2, 16, dtype=torch.long)).shape
        torch.Size([2, 16, 256])
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        head_dim, remainder = divmod(config.d_model, config.n_heads)
        if remainder or head_dim % 2:
            raise ValueError(
                f"ModelConfig d_model={config.d_model}, n_heads={config.n_heads}: d_model must be a multiple "
                f"of n_heads with an even head size (RoPE rotates pairs); pick e.g. n_heads=4."
            )
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.n_layers))
        self.final_norm = nn.RMSNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        cos, sin = _rotary_tables(config.context_len, head_dim)
        # Non-persistent buffers: not parameters, not in the state dict, not touched by any optimizer.
        self.register_buffer("rotary_cos", cos, persistent=False)
        self.register_buffer("rotary_sin", sin, persistent=False)
        self._init_weights()

    def _init_weights(self) -> None:
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, param in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(param, std=residual_std)
            elif param.ndim >= 2:
                nn.init.normal_(param, std=0.02)
            else:
                nn.init.ones_(param)

    def forward(self, tokens: Tensor) -> Tensor:
        """Next-token logits.

        Args:
            tokens: (batch, seq) int64 byte values in [0, 256), ``seq <= config.context_len``.

        Returns:
            (batch, seq, 256) float32 logits; position ``t`` predicts byte ``t + 1``.

        Raises:
            ValueError: ``seq`` exceeds ``config.context_len``.
        """
        seq = tokens.shape[1]
        if seq > self.config.context_len:
            raise ValueError(
                f"ByteTransformer got seq={seq} > context_len={self.config.context_len}; "
                f"build the model with a larger context_len."
            )
        cos, sin = self.rotary_cos[:seq], self.rotary_sin[:seq]
        x = self.embed_tokens(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.lm_head(self.final_norm(x))

    def loss(self, batch: Tensor) -> Tensor:
        """Mean next-byte cross-entropy.

        Args:
            batch: (batch, seq + 1) uint8 or int64 byte windows; inputs are ``[:, :-1]``, targets ``[:, 1:]``.

        Returns:
            0-dim float32 loss in nats per byte (``ln 256 ≈ 5.545`` for a uniform prediction).
        """
        batch = batch.long()
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def build_model(size: str, context_len: int, seed: int) -> ByteTransformer:
    """Build a freshly initialised model; the same ``(size, context_len, seed)`` gives identical weights.

    Args:
        size: a key of :data:`MODEL_SIZES` (``"tiny"`` or ``"small"``).
        context_len: rotary table length in tokens, >= the sequence length used for training.
        seed: seed for ``torch.manual_seed`` before initialisation (CPU, deterministic).

    Returns:
        the model in float32 on CPU, in training mode.

    Raises:
        ValueError: ``size`` is not a known size.
    """
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; choose one of {sorted(MODEL_SIZES)}.")
    base = MODEL_SIZES[size]
    config = ModelConfig(
        d_model=base.d_model,
        n_layers=base.n_layers,
        n_heads=base.n_heads,
        d_ff=base.d_ff,
        context_len=context_len,
        vocab_size=base.vocab_size,
    )
    torch.manual_seed(seed)
    return ByteTransformer(config)
