"""Normalisation and rotary-embedding helpers shared by the fused ops and by the models.

A fused op is byte-identical to its unfused form only if both compute the normalised / rotated
values the same way, so the models call these exact functions on their unfused paths.

Numerics: every helper computes in float32 and rounds once to the input dtype at the end.

RoPE ``cos_sin_cache`` layout (vLLM): ``[max_position, rot_dim]`` = ``cat(cos[rot_dim/2], sin[rot_dim/2])``.

* interleaved (GPT-J style): pairs ``(x[2i], x[2i+1])`` rotate by angle ``i``.
* NeoX style: pairs ``(x[i], x[i + rot_dim/2])`` rotate by angle ``i``.
"""

from __future__ import annotations

from typing import Literal

import torch

RopeStyle = Literal["interleaved", "neox"]
RopeDims = Literal["first", "last"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim (``weight=None``: no weight)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dim (biased variance)."""
    xf = x.float()
    mean = xf.mean(dim=-1, keepdim=True)
    centered = xf - mean
    var = centered.pow(2).mean(dim=-1, keepdim=True)
    y = centered * torch.rsqrt(var + eps) * weight.float() + bias.float()
    return y.to(x.dtype)


def rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    style: RopeStyle,
    dims: RopeDims = "first",
) -> torch.Tensor:
    """Rotate the first or last ``rot_dim = cos_sin_cache.shape[-1]`` dims of ``x [T, ..., D]``.

    ``positions [T]`` index ``cos_sin_cache``; the other dims of ``x`` pass through unchanged.
    """
    rot_dim = cos_sin_cache.shape[-1]
    half = rot_dim // 2
    cos_sin = cos_sin_cache[positions].float()  # [T, rot_dim]
    # broadcast over any head dims between T and D
    shape = (cos_sin.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos = cos_sin[:, :half].reshape(shape)
    sin = cos_sin[:, half:].reshape(shape)
    d = x.shape[-1]
    if dims == "first":
        rot, rest = x[..., :rot_dim], x[..., rot_dim:]
    else:
        rot, rest = x[..., d - rot_dim:], x[..., : d - rot_dim]
    r = rot.float()
    if style == "interleaved":
        even, odd = r[..., 0::2], r[..., 1::2]
        rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    else:
        first, second = r[..., :half], r[..., half:]
        rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    rotated = rotated.to(x.dtype)
    if dims == "first":
        return torch.cat((rotated, rest), dim=-1)
    return torch.cat((rest, rotated), dim=-1)
