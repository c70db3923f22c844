"""Small pieces shared by the Triton attention kernels."""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True when Triton runs its CPU interpreter (TRITON_INTERPRET=1): launch configs then favour small
    blocks, and GPU-only tuning is skipped."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_args(dtype: torch.dtype) -> dict:
    """Constexpr kernel arguments for `mma`. fp32 inputs would otherwise go through TF32 on tensor cores
    (~1e-3 relative error), so they ask for IEEE products. The CPU interpreter multiplies bf16 tiles as raw
    integers (triton 3.9), so there the tiles are widened to fp32 first; values are unchanged."""
    return {
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "UPCAST_DOT": interpreting() and dtype == torch.bfloat16,
    }


def check_pool_args(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> tuple[int, int, int]:
    """-> (num_heads, num_kv_heads, head_dim) after checking the shapes the kernels rely on."""
    if q.dim() != 3 or k_buffer.dim() != 3 or v_buffer.shape != k_buffer.shape:
        raise ValueError(f"expected q [T, H, D] and k/v buffers [slots, KVH, D]; got {q.shape}, {k_buffer.shape}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_buffer.shape[1]
    if k_buffer.shape[2] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit kv buffers {tuple(k_buffer.shape)}")
    if k_buffer.stride(2) != 1 or v_buffer.stride(2) != 1 or q.stride(2) != 1:
        raise ValueError("head_dim must be the contiguous (last) dimension of q and the kv buffers")
    return num_heads, num_kv_heads, head_dim


_INTERPRETING = tl.constexpr(interpreting())  # fixed at import (tests set TRITON_INTERPRET before importing Triton)
FP8_E4M3_MAX = tl.constexpr(448.0)


@triton.jit
def to_e4m3(x):
    """float32 x (already divided by its scale) -> e4m3, saturating at +-448, rounding to nearest even. Triton's CPU
    interpreter (3.9) loses the carry when rounding crosses a power of two (124.1 -> 64), so there the value is
    first rounded onto the e4m3 grid in float32 (3 mantissa bits; subnormal step 2^-9), making the cast exact."""
    x = tl.clamp(x, -FP8_E4M3_MAX, FP8_E4M3_MAX)
    if _INTERPRETING:
        mag = tl.abs(x)
        exponent = tl.maximum(tl.floor(tl.log2(tl.maximum(mag, 1e-30))), -6.0)
        step = tl.exp2(exponent - 3.0)
        magic = 12582912.0  # 1.5 * 2^23: adding and subtracting it rounds |v| < 2^22 to an integer, ties to even
        x = ((x / step + magic) - magic) * step
    return x.to(tl.float8e4nv)


def kv_scale_args(k_buffer: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> dict:
    """The attention kernels' FP8 K/V arguments (KScale, VScale, HAS_KV_SCALE): an e4m3 pool stores K / k_scale and
    V / v_scale, one float32 scale per kv head ([KVH] each), and needs both; a float pool takes none."""
    quantized = k_buffer.dtype == torch.float8_e4m3fn
    if quantized != (k_scale is not None) or (k_scale is None) != (v_scale is None):
        raise ValueError("an e4m3 K/V pool needs k_scale and v_scale ([KVH] float32); a float pool takes neither")
    if not quantized:
        return {"KScale": k_buffer, "VScale": k_buffer, "HAS_KV_SCALE": False}
    kvh = k_buffer.shape[1]
    for s in (k_scale, v_scale):
        if s.shape != (kvh,) or s.dtype != torch.float32 or s.device != k_buffer.device:
            raise ValueError(f"k/v scales must be [{kvh}] float32 on {k_buffer.device}, got {tuple(s.shape)} {s.dtype}")
    return {"KScale": k_scale, "VScale": v_scale, "HAS_KV_SCALE": True}


@triton.jit
def mma(a, b, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """a @ b with fp32 accumulation."""
    if UPCAST_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def softcap_scores(s, logit_softcap):
    """logit_softcap * tanh(s / logit_softcap), written with exp so it runs everywhere (no libdevice)."""
    x = s / logit_softcap
    t = tl.exp(-2.0 * tl.abs(x))
    th = (1.0 - t) / (1.0 + t)
    return logit_softcap * tl.where(x < 0, -th, th)


LOG2E = 1.4426950408889634  # scores are kept in base 2 (exp2 is one instruction; exp is exp2 and a multiply)


@triton.jit
def kv_head_scales(qk_scale, KScale, VScale, kv_head, HAS_KV_SCALE: tl.constexpr):
    """(score scale, V scale) of a kv head: e4m3 K/V put the head's K scale into the score scale and its V scale
    onto the output; otherwise the score scale as given and 1.0."""
    v_scale = 1.0
    if HAS_KV_SCALE:
        qk_scale = qk_scale * tl.load(KScale + kv_head)
        v_scale = tl.load(VScale + kv_head)
    return qk_scale, v_scale


@triton.jit
def attend_block(
    q, acc, m_i, l_i, k, v, q_pos, q_hi, k_pos, key_ok, qk_scale, logit_softcap, sliding_window,
    MASK_KEYS: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):  # fmt: skip
    """One online-softmax step: fold keys k/v ([BLOCK_N, BLOCK_D]) into (acc, m_i, l_i) for queries q (the extend,
    decode and cascade kernels' shared inner step). key_ok masks keys outside the range when MASK_KEYS; q_pos,
    q_hi, k_pos and sliding_window are read only when CAUSAL or HAS_WINDOW. CAUSAL: a query sees keys below its
    q_hi (its position + 1, or its bidirectional block's end).
    Scores, m_i and the exponentials are in base 2: qk_scale is sm_scale * log2(e) (sm_scale alone with a
    softcap, which applies to the natural-scale scores first)."""
    s = mma(q, tl.trans(k), DOT_PRECISION, UPCAST_DOT) * qk_scale  # s: [BLOCK_M, BLOCK_N]
    if HAS_SOFTCAP:
        s = softcap_scores(s, logit_softcap) * 1.4426950408889634
    if MASK_KEYS:  # block may hold keys past the range end or after some queries
        visible = key_ok[None, :]
        if CAUSAL:
            visible = visible & (k_pos[None, :] < q_hi[:, None])
        s = tl.where(visible, s, float("-inf"))
    if HAS_WINDOW:
        s = tl.where(k_pos[None, :] > q_pos[:, None] - sliding_window, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row can see nothing in this block (window): keep its max finite so exp2() gives 0, not NaN.
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
    return acc, m_new, l_i


@triton.jit
def store_split(o_ptrs, lse_ptrs, acc, m_i, l_i, v_scale, row_ok, mask_d, nonempty, HAS_KV_SCALE: tl.constexpr):
    """A split's partial output (acc / l, times the V scale of e4m3 K/V) and its natural-log LSE from the base-2
    running max m_i and sum l_i; an empty split stores only LSE -inf, which the merge weighs 0."""
    if nonempty:
        if HAS_KV_SCALE:
            acc = acc * v_scale
        tl.store(o_ptrs, acc / l_i[:, None], mask=row_ok[:, None] & mask_d[None, :])
        tl.store(lse_ptrs, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=row_ok)
    else:
        tl.store(lse_ptrs, tl.zeros_like(l_i) - float("inf"), mask=row_ok)


def qk_scale(sm_scale: float, logit_softcap: float | None) -> float:
    """The kernels' score scale: sm_scale * log2(e), giving base-2 scores; sm_scale alone with a soft-cap, which
    applies to the natural-scale scores first (the kernels multiply by log2(e) after it)."""
    return sm_scale if logit_softcap else sm_scale * LOG2E


def page_span(page_size: int, block_n: int) -> int:
    """Positions the kernels read per request-table lookup (their PAGE_SPAN): gcd(page_size, block_n), so a
    run never crosses a page and a BLOCK_N block holds whole runs. 1 for page_size 1 (slot by slot)."""
    return math.gcd(page_size, block_n)


@triton.jit
def paged_slots(RowPtr, n0, end, BLOCK_N: tl.constexpr, PAGE_SPAN: tl.constexpr):
    """Pool slots of positions n0 + [0, BLOCK_N) of one request-table row (RowPtr points at its position 0),
    reading the table once per run of PAGE_SPAN positions: slot(n0 + j*PAGE_SPAN + i) = row[n0 + j*PAGE_SPAN] + i.
    Needs n0 % PAGE_SPAN == 0 and PAGE_SPAN dividing the pool's page size (see page_span); valid because a
    page's slots are contiguous and every row maps a page-aligned run of positions onto one page (the
    KVManager's layout: slot(p) = pages[p // page_size] * page_size + p % page_size). Runs starting at or
    past `end` read slot 0.. instead (their positions are masked by the caller)."""
    first = n0 + tl.arange(0, BLOCK_N // PAGE_SPAN) * PAGE_SPAN
    base = tl.load(RowPtr + first, mask=first < end, other=0).to(tl.int64)  # base: [BLOCK_N // PAGE_SPAN]
    return tl.reshape(base[:, None] + tl.arange(0, PAGE_SPAN)[None, :], [BLOCK_N])


# ------------------------------------------------------------------ programmatic dependent launch (PDL)
# On Hopper and later a kernel launched with PDL may start while the kernel before it in the stream is still
# running: its programs are scheduled as soon as every program of that kernel has signalled (pdl_trigger, which
# the decode-path kernels do right after their own wait), and `pdl_wait` then blocks until that kernel has completed and its
# writes are visible. A kernel may do work that depends on nothing the earlier kernels write before the wait
# (the GEMV loads its first weight tile there); everything else, every write included, comes after it. The
# launch and the kernel's own constexpr both follow `pdl_args`, so with PDL off (the default, the CPU, the
# interpreter, older GPUs) the kernels compile and launch exactly as before. The wait is transitive: a kernel
# past its wait knows every earlier kernel in the stream has completed, whether or not those used PDL.
_PDL = {"enabled": False}


def set_pdl(enabled: bool) -> None:
    """Launch the decode-path kernels with PDL (applies to kernels launched, or graphs captured, after this)."""
    _PDL["enabled"] = bool(enabled)


_PDL_DEVICES: dict[int, bool] = {}


def pdl_supported(device: torch.device) -> bool:
    if device.type != "cuda" or interpreting():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _PDL_DEVICES:
        _PDL_DEVICES[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _PDL_DEVICES[index]


PDL_MAX_ROWS = 1  # PDL only for launches of at most this many rows (tokens). Measured on an H200 (Llama-3-8B
# shape, docs/benchmarks.md): batch 1 at 4k context 4.79 -> 4.57 ms a decode step; batch 8 5.29 -> 5.34 ms with
# PDL up to 16 rows (the GEMV then replaces cuBLAS on gate_up and down, which costs more than the overlap
# saves); batch 64 7.03 -> 7.49 ms with it up to 64 rows (the GEMV's pipeline also loses a stage there)


def pdl_args(t: torch.Tensor, rows: int) -> dict:
    """Kernel launch arguments for a launch over `rows` rows (tokens or sequences): {} (PDL off), or the
    kernel's USE_PDL constexpr plus Triton's launch flag."""
    if _PDL["enabled"] and rows <= PDL_MAX_ROWS and t.is_cuda and pdl_supported(t.device):
        return {"USE_PDL": True, "launch_pdl": True}
    return {}


@triton.jit
def pdl_trigger(USE_PDL: tl.constexpr):
    """Let the next kernel in the stream be scheduled (it still waits for this one before its dependent work)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait until the kernel before this one in the stream has completed and its writes are visible."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_begin(USE_PDL: tl.constexpr):
    """pdl_wait, then pdl_trigger: a kernel whose every access may depend on the kernel before it. Signalling
    only once past the wait keeps at most one kernel waiting behind the running one (a kernel that signalled
    first would let the whole rest of the forward become resident and wait)."""
    pdl_wait(USE_PDL)
    pdl_trigger(USE_PDL)
