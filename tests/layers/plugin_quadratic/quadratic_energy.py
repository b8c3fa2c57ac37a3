"""A toy interaction energy that is new math (the energy file of a two-file plugin, tests/layers/test_plugin_energy.py).

Per token ``i`` and head ``k``, with ``q^k_i = W^Q_k g_i`` and ``k^k_j = W^K_k ĥ_j`` (no softmax)::

    ε_i = − 1/(2τ(i+1)) Σ_k Σ_{j≤i} (q^k_i · k^k_j)²
    ∇_{g_i} ε = − 1/(τ(i+1)) Σ_k W^Q_kᵀ Σ_{j≤i} (q^k_i · k^k_j) k^k_j

Pure functions: tensors in, tensors out.
"""
import torch


def _heads(x, n_heads):
    b, n, hd = x.shape
    return x.view(b, n, n_heads, hd // n_heads).transpose(1, 2)  # (B, H, N, d_h)


def _weights(q, keys, tau):
    """(q·k)/(τ(i+1)) for j ≤ i, else 0: (B, H, N, S); the queries are the last N of S positions."""
    n, s = q.shape[-2], keys.shape[-2]
    pos = torch.arange(s - n, s, device=q.device)
    allowed = torch.arange(s, device=q.device)[None, :] <= pos[:, None]
    scores = (q @ keys.transpose(-1, -2)) * allowed
    return scores / (tau * (pos + 1).to(q.dtype))[:, None]


def quadratic_energy(g, h_ctx, w_q, w_k, n_heads, tau):
    """Per-token energy (B, N) of g (B, N, d) given h_ctx (B, N, d); w_q, w_k (H·d_h, d)."""
    q, k = _heads(g @ w_q.t(), n_heads), _heads(h_ctx @ w_k.t(), n_heads)
    return -0.5 * (_weights(q, k, tau) * (q @ k.transpose(-1, -2))).sum(-1).sum(1)


def quadratic_grad(g, keys, w_q, n_heads, tau):
    """Analytic gradient (B, N, d) of quadratic_energy w.r.t. g, given every position's keys (B, H, S, d_h)."""
    q = _heads(g @ w_q.t(), n_heads)
    y = _weights(q, keys, tau) @ keys  # (B, H, N, d_h)
    b, _, n, _ = y.shape
    return -(y.transpose(1, 2).reshape(b, n, -1) @ w_q)
