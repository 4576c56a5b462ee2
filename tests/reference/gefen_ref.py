"""Dense float64 reference of one Gefen update (algorithm.md §6.2 / §6.4), written from the math with loops
over blocks and explicit arg-min nearest codes. Slow and obviously correct; used to check the optimizer."""

from __future__ import annotations

import math

import torch


def nearest_code_ref(u: float, codebook: list[float]) -> int:
    """Arg-min over all codes of |u - c_k|, the lower index winning ties (algorithm.md §4.8)."""
    best, best_d = 0, math.inf
    for k, c in enumerate(codebook):
        d = abs(u - c)
        if d < best_d:
            best, best_d = k, d
    return best


class GefenReference:
    """One parameter's Gefen state and update, in float64, one block at a time."""

    def __init__(self, shape, period, codebook, factored, betas=(0.9, 0.999), eps=1e-8):
        self.shape = tuple(shape)
        self.n = math.prod(self.shape)
        self.period = period
        self.blocks = self.n // period
        self.codebook = [float(c) for c in codebook]
        self.factored = factored
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.codes = [0] * self.n
        self.scale = [0.0] * self.blocks
        self.v = [0.0] * self.blocks
        if factored:
            self.v_row = [0.0] * self.shape[0]
            self.v_col = [0.0] * self.shape[1]
        self.t = 0

    def step(self, param: torch.Tensor, grad: torch.Tensor, lr: float, weight_decay: float) -> torch.Tensor:
        g = grad.double().reshape(-1).tolist()
        p = param.double().reshape(-1).tolist()
        b1, b2, P = self.beta1, self.beta2, self.period
        self.t += 1
        bc1, bc2 = 1 - b1**self.t, 1 - b2**self.t
        step_size = [0.0] * self.n
        if self.factored:
            R, C = self.shape
            for r in range(R):
                rho = sum(g[r * C + c] ** 2 for c in range(C)) / C
                self.v_row[r] = b2 * self.v_row[r] + (1 - b2) * rho
            for c in range(C):
                kappa = sum(g[r * C + c] ** 2 for r in range(R)) / R
                self.v_col[c] = b2 * self.v_col[c] + (1 - b2) * kappa
            norm = max(sum(self.v_row) / R, 1.1754943508222875e-38)
            for r in range(R):
                for c in range(C):
                    v_hat = self.v_row[r] * self.v_col[c] / norm
                    step_size[r * C + c] = (1 / bc1) / (math.sqrt(v_hat / bc2) + self.eps)
        else:
            for b in range(self.blocks):
                ms = sum(x * x for x in g[b * P : (b + 1) * P]) / P
                self.v[b] = b2 * self.v[b] + (1 - b2) * ms
                s = (1 / bc1) / (math.sqrt(self.v[b]) / math.sqrt(bc2) + self.eps)
                for j in range(b * P, (b + 1) * P):
                    step_size[j] = s
        out = []
        for b in range(self.blocks):
            m = [b1 * self.codebook[self.codes[j]] * self.scale[b] + (1 - b1) * g[j] for j in range(b * P, (b + 1) * P)]
            a = max(abs(x) for x in m)
            self.scale[b] = a
            for k, j in enumerate(range(b * P, (b + 1) * P)):
                u = m[k] / a if a > 0 else 0.0
                self.codes[j] = nearest_code_ref(u, self.codebook)
                m_hat = self.codebook[self.codes[j]] * a
                out.append(p[j] * (1 - lr * weight_decay) - lr * step_size[j] * m_hat)
        return torch.tensor(out, dtype=torch.float64).reshape(self.shape)
