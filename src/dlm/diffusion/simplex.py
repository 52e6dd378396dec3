"""Simplex diffusion (TESS 2 §3.1): tokens as k-logit simplices, a cosine noise schedule over T training timesteps,
DDPM forward noising, the reverse step and the projections back onto the k-logit simplex. Pure tensor functions."""

from __future__ import annotations

import math

import torch

from dlm.modeling.device import categorical


def cosine_alpha_bar(timesteps: int, offset: float = 1e-4) -> torch.Tensor:
    """ᾱ_t for t = 0 … T−1: f(t/T) / f(0) with f(u) = cos²((u + s)/(1 + s) · π/2) (Nichol & Dhariwal 2021, Eq. 17),
    s = `offset` (TESS uses 1e-4). ᾱ_0 = 1 and ᾱ decreases towards 0 at t = T."""
    if timesteps < 1:
        raise ValueError(f"timesteps must be >= 1, got {timesteps}")
    u = torch.arange(timesteps, dtype=torch.float64) / timesteps
    f = torch.cos((u + offset) / (1 + offset) * math.pi / 2) ** 2
    f0 = math.cos(offset / (1 + offset) * math.pi / 2) ** 2
    return (f / f0).clamp(min=0.0, max=1.0).float()


def to_simplex(ids: torch.Tensor, vocab_size: int, k: float) -> torch.Tensor:
    """The k-logit simplex of token ids: +k at the token, −k elsewhere (TESS 2 Eq. 1). [...] → [..., V]."""
    s = torch.full((*ids.shape, vocab_size), -float(k), dtype=torch.float32, device=ids.device)
    return s.scatter_(-1, ids.unsqueeze(-1), float(k))


def from_simplex(s: torch.Tensor) -> torch.Tensor:
    """Token ids of (noisy) simplices: the argmax over the vocabulary."""
    return s.argmax(-1)


def noise_simplex(s0: torch.Tensor, alpha_bar: torch.Tensor, noise: torch.Tensor, k: float) -> torch.Tensor:
    """S_t = √ᾱ_t S_0 + √(1−ᾱ_t) ε with ε = k·z, z ~ N(0, I) given as `noise` (TESS 2 Eq. 2).
    `alpha_bar` is per sequence [B] (one timestep per sequence); s0 and noise are [B, L, V]."""
    a = alpha_bar.to(s0.dtype).view(-1, *([1] * (s0.dim() - 1)))
    return a.sqrt() * s0 + (1 - a).sqrt() * float(k) * noise


def project_argmax(logits: torch.Tensor, k: float) -> torch.Tensor:
    """Ŝ: the k-logit simplex of the argmax token (TESS 2 Eq. 5)."""
    return to_simplex(logits.argmax(-1), logits.shape[-1], k)


def top_p_sample(logits: torch.Tensor, top_p: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """A token per position from the smallest set of tokens whose probability reaches `top_p` (nucleus sampling)."""
    probs = torch.softmax(logits.float(), dim=-1)
    sorted_p, order = probs.sort(-1, descending=True)
    keep = sorted_p.cumsum(-1) - sorted_p < top_p  # the top token is always kept
    sorted_p = sorted_p * keep
    pick = categorical(sorted_p / sorted_p.sum(-1, keepdim=True), generator)
    return order.gather(-1, pick[..., None]).squeeze(-1)


def project_top_p(logits: torch.Tensor, k: float, top_p: float,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Ŝ: the k-logit simplex of a top-p sample from softmax(logits) (the TESS public configs' projection, p = 0.99)."""
    return to_simplex(top_p_sample(logits, top_p, generator), logits.shape[-1], k)


def reverse_step(s_hat: torch.Tensor, alpha_bar_prev: float, noise: torch.Tensor, k: float) -> torch.Tensor:
    """S_{t−1} = √ᾱ_{t−1} Ŝ + √(1−ᾱ_{t−1}) ε, ε = k·z (TESS 2 Eq. 4): re-noise the projected prediction."""
    a = float(alpha_bar_prev)
    return math.sqrt(a) * s_hat + math.sqrt(max(1.0 - a, 0.0)) * float(k) * noise


def inference_timesteps(timesteps: int, steps: int) -> list[int]:
    """`steps` timesteps spaced evenly from T−1 down to 0 over the T training timesteps (descending, distinct)."""
    if steps < 1:
        raise ValueError(f"inference steps must be >= 1, got {steps}")
    steps = min(steps, timesteps)
    if steps == 1:
        return [timesteps - 1]
    grid = torch.linspace(timesteps - 1, 0, steps).round().long().tolist()
    return list(dict.fromkeys(grid))
