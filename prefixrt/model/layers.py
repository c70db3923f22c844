"""Building blocks shared by the model families: RMSNorm, rotary embedding, fused linears, gated MLP.

Numerics follow transformers exactly (dtype casts included), because transformers is our oracle: a model
built from these pieces in float32 reproduces its logits to float rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# ----------------------------------------------------------------------------------------------- norms


class RMSNorm(nn.Module):
    """Llama-style RMSNorm: normalise in float32, cast back, then multiply by `weight` (identity = 1)."""

    identity_weight = 1.0

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., dim]
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma-style RMSNorm: scales by (1 + weight) in float32 before the cast back (identity = 0)."""

    identity_weight = 0.0

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., dim]
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).type_as(x)


# ------------------------------------------------------------------------------------------------ rope

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters in transformers' `rope_parameters` vocabulary (one layer type)."""

    head_dim: int  # rotated dims (the whole head: partial rotary is not supported)
    theta: float
    rope_type: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0  # linear / llama3: how much the context was stretched
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only

    def __post_init__(self):
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise NotImplementedError(
                f"rope_type {self.rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if self.head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {self.head_dim}")
        if self.theta <= 0 or self.factor <= 0:
            raise ValueError(f"rope theta and factor must be positive, got {self.theta}, {self.factor}")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("llama3 rope needs high_freq_factor > low_freq_factor")

    @classmethod
    def from_parameters(
        cls, params: Mapping[str, Any] | None, *, head_dim: int, default_theta: float, max_position_embeddings: int
    ) -> RopeConfig:
        """From one (non-nested) transformers `rope_parameters` / legacy `rope_scaling` dict."""
        p = dict(params or {})
        if p.get("partial_rotary_factor", 1.0) != 1.0:
            raise NotImplementedError("partial_rotary_factor != 1 is not supported")
        rope_type = p.get("rope_type", p.get("type", "default"))
        return cls(
            head_dim=head_dim,
            theta=float(p.get("rope_theta") or default_theta),
            rope_type=rope_type,
            factor=float(p.get("factor", 1.0)) if rope_type != "default" else 1.0,
            low_freq_factor=float(p.get("low_freq_factor", 1.0)),
            high_freq_factor=float(p.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                p.get("original_max_position_embeddings") or max_position_embeddings
            ),
        )

    def inv_freq(self) -> torch.Tensor:  # [head_dim // 2] float32, on CPU
        """Inverse frequencies, computed exactly as transformers' ROPE_INIT_FUNCTIONS do."""
        dim = self.head_dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
        if self.rope_type == "linear":
            inv_freq = inv_freq / self.factor
        elif self.rope_type == "llama3":
            low_freq_wavelen = self.original_max_position_embeddings / self.low_freq_factor
            high_freq_wavelen = self.original_max_position_embeddings / self.high_freq_factor
            wavelen = 2 * math.pi / inv_freq
            scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
            smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
            inv_freq = torch.where(is_medium, smoothed, scaled)
        return inv_freq


def hf_rope_parameters(hf_config) -> dict[str, Any]:
    """The config's rope parameters as one dict, whichever spelling the config uses.

    transformers >= 5 stores them in `rope_parameters` (rope_theta inside; possibly nested by layer type);
    older configs use `rope_theta` plus an optional `rope_scaling` dict. Returns a new dict (never the
    config's own), flat or nested exactly as the config has it.
    """
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, Mapping) and params:
        return {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in params.items()}
    legacy = dict(getattr(hf_config, "rope_scaling", None) or {})
    theta = getattr(hf_config, "rope_theta", None)
    if theta is not None:
        legacy.setdefault("rope_theta", theta)
    return legacy


class RotaryEmbedding(nn.Module):
    """cos/sin tables for the given positions, computed on the fly (no max-length cache to size)."""

    def __init__(self, config: RopeConfig):
        super().__init__()
        self.config = config
        # Plain attributes, not buffers: they must survive meta-device construction and dtype casts.
        self._inv_freq_cpu = config.inv_freq()  # [head_dim // 2] float32
        self._inv_freq = self._inv_freq_cpu

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64 -> (cos, sin), each [T, head_dim] float32."""
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq_cpu.to(positions.device)
        freqs = positions[:, None].float() * self._inv_freq[None, :]  # [T, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]
        return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style (rotate-half) RoPE. x: [T, heads, head_dim]; cos, sin: [T, head_dim] float32.
    cos/sin are cast to x's dtype first, as transformers does."""
    cos = cos.to(x.dtype)[:, None, :]  # [T, 1, head_dim]
    sin = sin.to(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# --------------------------------------------------------------------------------------------- linears


class MergedLinear(nn.Linear):
    """Several projections of the same input fused into one matmul (q/k/v, gate/up).

    `shard_names[i]` is the checkpoint name of output rows [offset_i, offset_i + shard_sizes[i]); the weight
    loader uses these to place each checkpoint tensor.
    """

    def __init__(self, in_features: int, shard_sizes: list[int], shard_names: list[str], bias: bool):
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        if len(shard_sizes) != len(shard_names):
            raise ValueError("one name per shard")
        self.shard_sizes = list(shard_sizes)
        self.shard_names = list(shard_names)

    def shard_slice(self, shard_name: str) -> tuple[int, int]:
        """(offset, size) of the named shard along the output dimension."""
        i = self.shard_names.index(shard_name)
        return sum(self.shard_sizes[:i]), self.shard_sizes[i]


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise NotImplementedError(f"activation {name!r} not supported; supported: {sorted(_ACTIVATIONS)}") from None


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool = False):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = MergedLinear(
            hidden_size, [intermediate_size, intermediate_size], ["gate_proj", "up_proj"], bias=bias
        )
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, hidden]
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # each [T, intermediate]
        return self.down_proj(self.act(gate) * up)
