"""Programmatic dependent launch (kernels/_common.py): the decode-path kernels give bit-identical results with
PDL on and off, eagerly and as one captured CUDA graph replayed over fresh inputs (a kernel reading its input
before the previous kernel finished writing it would show up as a difference). GPU-only (Hopper or later); on
the CPU the flag must leave every launch unchanged, and the GEMV fallback plan is checked."""

from __future__ import annotations

import pytest
import torch
from prefixrt.kernels import _common
from prefixrt.kernels.gemv import GemvConfig

from prefixrt.model.layers import MEASURED_ROWS, gemv_fallback

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def test_pdl_args_are_empty_off_the_gpu_or_when_disabled():
    x = torch.zeros(2)
    _common.set_pdl(True)
    try:
        assert _common.pdl_args(x, 1) == {}  # a CPU tensor never launches with PDL
    finally:
        _common.set_pdl(False)
    if torch.cuda.is_available():
        assert _common.pdl_args(x.cuda(), 1) == {}  # disabled
        if HOPPER:
            _common.set_pdl(True)
            try:
                assert _common.pdl_args(x.cuda(), 1) and not _common.pdl_args(x.cuda(), _common.PDL_MAX_ROWS + 1)
            finally:
                _common.set_pdl(False)


def test_gemv_fallback_fills_cublas_rows_from_the_nearest_layout():
    a, b = GemvConfig(32, 256, 1, 4, 4), GemvConfig(128, 64, 1, 8, 3)
    measured = {rows: None for rows in MEASURED_ROWS}
    assert gemv_fallback(measured) == measured  # no layout at any row count: cuBLAS stays
    measured[1], measured[32] = a, b
    out = gemv_fallback(measured)
    assert out[1] == a and out[2] == a and out[32] == b and out[64] == b
    assert out[16] == a  # 15 rows from 1, 16 from 32
    measured = {rows: None for rows in MEASURED_ROWS}
    measured[1] = a
    assert gemv_fallback(measured)[64] == GemvConfig(32, 256, 1, 4, 3)  # taller tile: 3 stages
    limited = gemv_fallback(measured, max_rows=16)
    assert limited[16] == a and limited[32] is None and limited[64] is None  # cuBLAS stays above max_rows


def _chain(x, res, w_norm, w_qkv, w_o, w_gate_up, w_down, cos, sin, loc, kbuf, vbuf, cfg_small, cfg_big):
    """One decoder layer's decode-path kernels in order (norm, qkv, rope + store, attention, o, norm, gate_up,
    act, down), as the fused model runs them."""
    from prefixrt.kernels.activation import act_mul
    from prefixrt.kernels.decode_attention import decode_attention
    from prefixrt.kernels.gemv import gemv
    from prefixrt.kernels.norm import add_rms_norm
    from prefixrt.kernels.rope import qk_norm_rope_store

    h, summed = add_rms_norm(x, w_norm, 1e-5, res)
    qkv = gemv(h, w_qkv, None, cfg_small)
    q = qk_norm_rope_store(qkv, cos, sin, loc, kbuf, vbuf, 8, 2, 64)
    o = torch.empty_like(q)
    t = x.shape[0]
    table = torch.arange(64, device=x.device, dtype=torch.int32).repeat(t, 1)
    seq_lens = torch.full((t,), 64, device=x.device, dtype=torch.int32)
    decode_attention(q, o, kbuf, vbuf, table, torch.arange(t, device=x.device), seq_lens, 0.125, num_kv_splits=4)
    attn = gemv(o.view(t, -1), w_o, None, cfg_small)
    h2, summed2 = add_rms_norm(attn, w_norm, 1e-5, summed)
    gu = gemv(h2, w_gate_up, None, cfg_big)
    return gemv(act_mul(gu), w_down, None, GemvConfig(32, 256, 2, 4, 3)), summed2


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.is_available() and not HOPPER, reason="PDL needs a Hopper (or later) GPU")
@pytest.mark.parametrize("rows", [1, 16])
def test_decode_chain_pdl_on_equals_off_eager_and_graph(rows):
    g = torch.Generator(device="cuda").manual_seed(rows)
    dev, bf = "cuda", torch.bfloat16

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(bf)

    hidden, inter = 512, 1024
    w = dict(w_norm=rnd(hidden), w_qkv=rnd(12 * 64, hidden, scale=hidden**-0.5),
             w_o=rnd(hidden, 8 * 64, scale=hidden**-0.5), w_gate_up=rnd(2 * inter, hidden, scale=hidden**-0.5),
             w_down=rnd(hidden, inter, scale=inter**-0.5))
    cos, sin = torch.rand(rows, 64, device=dev), torch.rand(rows, 64, device=dev)
    loc = torch.arange(rows, device=dev) + 64 - rows  # the query's own slot is the last one it reads
    small, big = GemvConfig(32, 256, 1, 4, 3), GemvConfig(128, 64, 1, 8, 3)
    x, res = rnd(rows, hidden), rnd(rows, hidden)
    kv0 = rnd(64, 2, 64), rnd(64, 2, 64)

    def run(pdl: bool, x_in, res_in):
        _common.set_pdl(pdl)
        try:
            kbuf, vbuf = kv0[0].clone(), kv0[1].clone()
            out, summed = _chain(x_in, res_in, **w, cos=cos, sin=sin, loc=loc, kbuf=kbuf, vbuf=vbuf,
                                 cfg_small=small, cfg_big=big)
            return out, summed, kbuf
        finally:
            _common.set_pdl(False)

    ref = run(False, x, res)
    got = run(True, x, res)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)

    # One graph of three chained layers captured with PDL, replayed over fresh inputs.
    sx, sres = x.clone(), res.clone()
    kbuf, vbuf = kv0[0].clone(), kv0[1].clone()
    _common.set_pdl(True)
    try:
        def layers():
            out, summed = sx, sres
            for _ in range(3):
                out, summed = _chain(out, summed, **w, cos=cos, sin=sin, loc=loc, kbuf=kbuf, vbuf=vbuf,
                                     cfg_small=small, cfg_big=big)
            return out, summed
        layers()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gout = layers()
    finally:
        _common.set_pdl(False)
    for _ in range(5):
        sx.copy_(rnd(rows, hidden))
        sres.copy_(rnd(rows, hidden))
        kbuf.copy_(kv0[0])
        vbuf.copy_(kv0[1])
        graph.replay()
        kb2, vb2 = kv0[0].clone(), kv0[1].clone()
        out, summed = sx, sres
        for _ in range(3):
            out, summed = _chain(out, summed, **w, cos=cos, sin=sin, loc=loc, kbuf=kb2, vbuf=vb2,
                                 cfg_small=small, cfg_big=big)
        torch.cuda.synchronize()
        assert torch.equal(gout[0], out) and torch.equal(gout[1], summed) and torch.equal(kbuf, kb2)
