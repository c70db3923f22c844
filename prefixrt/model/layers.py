"""Building blocks shared by the model families: RMSNorm, rotary embedding, fused linears, gated MLP.

Numerics follow transformers exactly (dtype casts included), because transformers is our oracle: a model
built from these pieces in float32 reproduces its logits to float rounding.

Every piece has two paths. The torch path is the reference and the default. `use_fused_kernels(model)`
switches a built model to the Triton kernels of prefixrt.kernels (add+RMSNorm, act*mul, q/k-norm + RoPE +
K/V store, small-batch GEMV); they follow the same casts, so outputs agree to rounding (tests compare
the two). The engine switches it on when attention runs on the Triton backend on CUDA.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from prefixrt.model.attention.base import AttentionBackend, AttentionLayer
from prefixrt.model.forward_batch import ForwardBatch
from prefixrt.model.fp8_linear import MEASURED_ROWS, expand_plan, fp8_linear, fp8_plan_for
from prefixrt.model.fp8_static_linear import fp8_linear_static
from prefixrt.model.lora import LoraBatch, with_lora

if TYPE_CHECKING:
    from prefixrt.kernels.gemv import GemvConfig

MAX_GEMV_ROWS = 64  # = prefixrt.kernels.gemv.MAX_M


@functools.cache
def _kernels() -> SimpleNamespace:
    """The Triton kernels of the fused path, imported on first use: the torch path never needs Triton, and
    TRITON_INTERPRET must be set before the kernel modules are first imported."""
    from prefixrt.kernels import _common, activation, gemv, norm, rope

    return SimpleNamespace(act_mul=activation.act_mul, gemv=gemv.gemv, GemvConfig=gemv.GemvConfig,
                           choose_gemv_config=gemv.choose_config, add_rms_norm=norm.add_rms_norm,
                           qk_norm_rope_store=rope.qk_norm_rope_store, set_pdl=_common.set_pdl)

# ----------------------------------------------------------------------------------------------- norms


class RMSNorm(nn.Module):
    """Llama-style RMSNorm: normalise in float32, cast back, then multiply by `weight` (identity = 1)."""

    identity_weight = 1.0
    gemma = False

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.fused = False  # set by use_fused_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., dim]
        if self.fused and x.dim() == 2:
            return _kernels().add_rms_norm(x, self.weight, self.eps, gemma=self.gemma)[0]
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self._scale(x32, x.dtype)

    def _scale(self, normed32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.weight * normed32.to(dtype)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream step of a pre-norm block: (norm(x + residual), x + residual); with residual
        None (the first block) it is (norm(x), x). x, residual: [T, dim]; neither is modified."""
        if self.fused:
            return _kernels().add_rms_norm(x, self.weight, self.eps, residual, gemma=self.gemma)
        summed = x if residual is None else x + residual
        return self(summed), summed


class GemmaRMSNorm(RMSNorm):
    """Gemma-style RMSNorm: scales by (1 + weight) in float32 before the cast back (identity = 0)."""

    identity_weight = 0.0
    gemma = True

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        self.weight = nn.Parameter(torch.zeros(dim))

    def _scale(self, normed32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (normed32 * (1.0 + self.weight.float())).to(dtype)


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

    def drop_device_copy(self) -> None:
        """Free the inverse frequencies' copy on the device (made again at the next forward there)."""
        self._inv_freq = self._inv_freq_cpu

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64 -> (cos, sin), each [T, head_dim] float32."""
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq_cpu.to(positions.device)
        freqs = positions[:, None].float() * self._inv_freq[None, :]  # [T, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]
        return emb.cos(), emb.sin()


def rope_and_attend(
    attn: AttentionBackend,
    layer: AttentionLayer,
    qkv: torch.Tensor,  # [T, (H + 2 * KVH) * D]: the fused q/k/v projection
    cos: torch.Tensor,  # [T, D] float32
    sin: torch.Tensor,
    batch: ForwardBatch,
    q_norm: RMSNorm | None = None,  # per-head q/k norms (Qwen3, Gemma-3), both or neither
    k_norm: RMSNorm | None = None,
    fused: bool = False,
) -> torch.Tensor:  # [T, H * D]
    """Optional per-head q/k norm, RoPE, K/V store into the pool and attention, for one layer. The fused
    path does the first three in one kernel (qk_norm_rope_store) and hands the backend q alone."""
    num_tokens = qkv.shape[0]
    h, kvh, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    if fused:
        k_buffer, v_buffer = attn.kv_buffers(layer)
        k_scale, v_scale = attn.kv_scales(layer)
        norm = {} if q_norm is None else dict(
            q_norm_weight=q_norm.weight, k_norm_weight=k_norm.weight, norm_eps=q_norm.eps, gemma_norm=q_norm.gemma
        )
        q = _kernels().qk_norm_rope_store(qkv, cos, sin, batch.out_cache_loc, k_buffer, v_buffer, h, kvh, d, **norm,
                                          k_scale=k_scale, v_scale=v_scale)
        return attn.forward(q.view(num_tokens, h * d), None, None, layer, batch)
    q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    q = q.view(num_tokens, h, d)  # [T, h, d]
    k = k.view(num_tokens, kvh, d)  # [T, kvh, d]
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    return attn.forward(q.reshape(num_tokens, h * d), k.reshape(num_tokens, kvh * d), v, layer, batch)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style (rotate-half) RoPE. x: [T, heads, head_dim]; cos, sin: [T, head_dim] float32.
    cos/sin are cast to x's dtype first, as transformers does."""
    cos = cos.to(x.dtype)[:, None, :]  # [T, 1, head_dim]
    sin = sin.to(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# --------------------------------------------------------------------------------------------- linears


class Linear(nn.Linear):
    """nn.Linear that runs small batches (at most MAX_GEMV_ROWS rows) on the Triton GEMV when use_fused_kernels
    planned a configuration for that row count (`gemv_plan[rows]`); cuBLAS otherwise.

    With FP8 weights (model/quantize.py sets them): `weight` is e4m3 and `weight_scale` holds its scales (per output
    channel [N], or [ceil(N / 128), ceil(K / 128)] blocks); model/fp8_linear.py computes, `fp8_plan` holding the
    weight-only kernel's layout per row count and `fp8_activation_scale` ("token", the default, "none" or "group",
    model/quantize.set_fp8_activation_scale) how inputs taller than a decode batch run, unless the checkpoint fixed
    the activations a static scale (`input_scale`, one value; model/fp8_static_linear.py computes)."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__(in_features, out_features, bias=bias)
        self.gemv_plan: dict[int, GemvConfig] = {}  # rows -> config; a missing row count runs cuBLAS
        self.register_parameter("weight_scale", None)  # set with FP8 weights
        self.register_parameter("input_scale", None)  # set with FP8 weights whose checkpoint has static activations
        self.fp8_plan: dict[int, GemvConfig] = {}  # rows -> weight-only FP8 layout (fp8_linear.fp8_plan_for)
        self.fp8_activation_scale = "token"  # one of kernels/fp8_reference.py's ACTIVATION_SCALES (EngineConfig's default)
        self.lora = None  # LoraWeights (model/lora.py) when the engine serves LoRA adapters through this projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_scale is not None and self.input_scale is not None:  # (served dequantized: weight_scale None)
            return fp8_linear_static(x, self.weight, self.weight_scale, self.bias, self.input_scale, self.fp8_plan)
        if self.weight_scale is not None:
            return fp8_linear(x, self.weight, self.weight_scale, self.bias, self.fp8_plan, self.fp8_activation_scale)
        config = self.gemv_plan.get(x.shape[0]) if x.dim() == 2 else None
        if config is not None:
            return _kernels().gemv(x, self.weight, self.bias, config)
        return F.linear(x, self.weight, self.bias)

    def checkpoint_slice(self, kind: str, param: torch.Tensor, offset: int, size: int, tensor: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(destination view of `param`, checkpoint tensor shaped to fit it) for rows [offset, offset + size) of this
        linear's output (a MergedLinear shard, or the whole). FP8 weight scales arrive per channel ([size] or [size,
        1]), per tensor (one value, spread over the rows) or per 128 x 128 block (rows of blocks)."""
        if kind != "weight_scale":
            return param.data.narrow(0, offset, size), tensor
        tensor = tensor.float()
        if param.dim() == 2:  # block-wise: [N / 128, K / 128]
            from prefixrt.kernels.fp8_reference import SCALE_BLOCK

            if offset % SCALE_BLOCK or (size % SCALE_BLOCK and offset + size != self.out_features):
                raise ValueError(f"block-wise FP8 scales need shards of whole {SCALE_BLOCK}-row blocks; a shard "
                                 f"covers rows [{offset}, {offset + size})")
            return param.data.narrow(0, offset // SCALE_BLOCK, -(-size // SCALE_BLOCK)), tensor
        if tensor.numel() == 1:
            tensor = tensor.reshape(1).expand(size)
        return param.data.narrow(0, offset, size), tensor.reshape(-1)

    def forward_gated(self, gate_up: torch.Tensor, config: GemvConfig, act: str) -> torch.Tensor:
        """self(act(gate) * up) on the GEMV with the gated activation fused in (GatedMLP's small batches).
        gate_up: [rows, 2 * in_features], gate first."""
        return _kernels().gemv(gate_up, self.weight, self.bias, config, act_input=act)


class MergedLinear(Linear):
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


# transformers activation names -> the fused kernels' names (exact-erf GELU has no fused kernel)
_FUSED_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool = False):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = MergedLinear(
            hidden_size, [intermediate_size, intermediate_size], ["gate_proj", "up_proj"], bias=bias
        )
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.act = activation(act)
        self.fused_act = _FUSED_ACTIVATIONS.get(act)
        self.fused = False  # set by use_fused_kernels
        # rows -> GEMV config of down_proj with act(gate) * up computed inside it (no activation kernel)
        self.down_act_plan: dict[int, GemvConfig] = {}

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:  # x: [T, hidden]
        """lora: the forward's LoRA plan (model/lora.py), or None (the base model only)."""
        gate_up = with_lora(self.gate_up_proj, x, lora)  # [T, 2 * intermediate]
        down_lora = lora if self.down_proj.lora is not None else None
        if self.fused and self.fused_act is not None:  # (down_act_plan is empty with FP8 weights)
            config = self.down_act_plan.get(gate_up.shape[0])
            if config is not None and down_lora is None:  # (a LoRA update of down_proj needs its input)
                return self.down_proj.forward_gated(gate_up, config, self.fused_act)
            return with_lora(self.down_proj, _kernels().act_mul(gate_up, self.fused_act), down_lora)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)  # each [T, intermediate]
        return with_lora(self.down_proj, self.act(gate) * up, down_lora)


# ------------------------------------------------------------------------------------- fused kernels

_GEMV_CHOICES: dict[tuple, tuple] = {}  # (n, k, rows, act, dtype, device name) -> (choice, timings)


def _table_choice(n: int, k: int, rows: int, act: str | None, dtype: torch.dtype, gpu: str):
    """-> (found, config or None) from the checked-in table (kernels/gemv_table.py; bf16 only)."""
    if dtype != torch.bfloat16:
        return False, None
    from prefixrt.kernels.gemv_table import MEASURED

    table = MEASURED.get(gpu, {})
    key = (n, k, rows, act)
    return key in table, table.get(key)


def gemv_choice(n: int, k: int, rows: int, act: str | None, dtype: torch.dtype, device, use_table: bool = True
                ) -> tuple[GemvConfig | None, dict]:
    """(fastest GEMV config for an [rows, k] x [k, n] product, None when cuBLAS is fastest; timings in us
    per candidate, empty when the choice came from the table). Taken from this process's earlier
    measurements, else (use_table) from the table measured on this GPU model and checked in
    (kernels/gemv_table.py), else measured now (kernels.gemv.choose_config) and remembered."""
    gpu = torch.cuda.get_device_name(device)
    key = (n, k, rows, act, dtype, gpu)
    if key in _GEMV_CHOICES:
        return _GEMV_CHOICES[key]
    if use_table:
        found, config = _table_choice(n, k, rows, act, dtype, gpu)
        if found:
            return config, {}
    _GEMV_CHOICES[key] = _kernels().choose_gemv_config(n, k, rows, dtype, device, act)
    return _GEMV_CHOICES[key]


def gemv_plan_for(weight: torch.Tensor, gemv: str, act: str | None = None, prefer_gemv: bool = False
                  ) -> dict[int, GemvConfig]:
    """rows (1..MAX_GEMV_ROWS) -> GEMV config, for one weight; row counts left out run cuBLAS. gemv:
    "table" (CUDA: the choices measured on this GPU model and checked in; shapes not in it run cuBLAS, so
    start-up measures nothing), "measure" (CUDA: like "table", but shapes missing from it are measured
    now: the fastest of the Triton layouts and cuBLAS per measured row count), "always" (the default layout
    for every row count: tests, the interpreter) or "never" (cuBLAS). prefer_gemv: where cuBLAS won a row
    count of a shape that has a GEMV layout at another row count, use that layout anyway (see gemv_fallback)."""
    if gemv == "never":
        return {}
    if gemv == "always":
        return {rows: _kernels().GemvConfig() for rows in range(1, MAX_GEMV_ROWS + 1)}
    if gemv not in ("table", "measure"):
        raise ValueError(f"gemv must be 'table', 'measure', 'always' or 'never', got {gemv!r}")
    if weight.device.type != "cuda":
        return {}
    n, k = weight.shape
    gpu = torch.cuda.get_device_name(weight.device)
    measured = {}
    for rows in MEASURED_ROWS:
        if gemv == "measure":
            measured[rows] = gemv_choice(n, k, rows, act, weight.dtype, weight.device)[0]
        else:
            key = (n, k, rows, act, weight.dtype, gpu)
            cached = _GEMV_CHOICES.get(key)  # measured earlier in this process (a benchmark)
            measured[rows] = cached[0] if cached else _table_choice(n, k, rows, act, weight.dtype, gpu)[1]
    if prefer_gemv:  # the row counts that launch with PDL (kernels/_common.py)
        from prefixrt.kernels._common import PDL_MAX_ROWS

        measured = gemv_fallback(measured, PDL_MAX_ROWS)
    return expand_plan(measured, MAX_GEMV_ROWS)


def gemv_fallback(measured: dict[int, GemvConfig | None], max_rows: int = MAX_GEMV_ROWS
                  ) -> dict[int, GemvConfig | None]:
    """Fill the row counts up to max_rows where cuBLAS won with the GEMV layout of the nearest row count that
    has one (its pipeline capped at 3 stages above 16 rows, where the taller input tile needs more shared
    memory). A shape with no layout at any row count stays on cuBLAS."""
    have = [m for m in MEASURED_ROWS if measured.get(m) is not None]
    if not have:
        return dict(measured)
    out = {}
    for rows in MEASURED_ROWS:
        config = measured.get(rows)
        if config is None and rows <= max_rows:
            config = measured[min(have, key=lambda m: (abs(m - rows), m))]
            if rows > 16 and config.num_stages > 3:
                config = dataclasses.replace(config, num_stages=3)
        out[rows] = config
    return out


def use_fused_kernels(model: nn.Module, enabled: bool = True, gemv: str = "table", pdl: bool = False) -> None:
    """Switch every norm, MLP, attention block and linear of `model` to the Triton kernels (enabled) or
    back to the torch reference path. gemv: see gemv_plan_for (FP8 linears: fp8_linear.fp8_plan_for, "table",
    "measure", "always" or "never" alike). pdl: launch the kernels with programmatic
    dependent launch (kernels/_common.py; process-wide) and run the GEMV for every row count of a shape the
    table knows (a cuBLAS launch would end each overlap). Mutates the modules' `fused` flags and GEMV plans
    only; weights are untouched. Call before capturing CUDA graphs: the plans are part of them."""
    if enabled or pdl:
        _kernels().set_pdl(enabled and pdl)
    for module in model.modules():
        if hasattr(module, "fused"):
            module.fused = enabled
        if isinstance(module, GatedMLP):
            act = module.fused_act
            bf16_down = module.down_proj.weight_scale is None
            module.down_act_plan = (gemv_plan_for(module.down_proj.weight, gemv, act)
                                    if enabled and act and bf16_down else {})
        if isinstance(module, Linear) and module.weight_scale is not None:
            module.gemv_plan = {}
            module.fp8_plan = fp8_plan_for(module.weight, module.weight_scale, gemv) if enabled else {}
        elif isinstance(module, Linear):
            module.gemv_plan = gemv_plan_for(module.weight, gemv, prefer_gemv=pdl) if enabled else {}
