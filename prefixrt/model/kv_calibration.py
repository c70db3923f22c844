"""Scales of an FP8 (e4m3) K/V cache: one per layer and kv head, for K and for V (cache/kv_pool.py stores K / scale).

They come from the checkpoint when it carries them (`model.kv_cache_scales`, hub/fp8_checkpoint.py), else they are
calibrated once at start-up (`calibrate_kv_scales`): one forward over a fixed English text into a temporary float32
pool, from which each head's largest magnitude is taken. The text is fixed, so the scales (and with them every
cached byte) are the same on every start of the same model: the disk tier and a restarted engine read the same
values, and a prefix always quantizes to the same bytes, which is what exact radix reuse needs. The scales never
change afterwards (a scale that moved with the data would give the same prefix other bytes later).

K is stored after RoPE, which rotates each pair of dims (i, i + D/2) by a position-dependent angle: a component of
K can reach its pair's norm at some position the calibration text never reached. So K's magnitude is taken as the
largest pair norm, which the rotation leaves unchanged; V's as its largest absolute value. HEADROOM leaves room for
tokens larger than any in the text (e4m3 keeps 3 mantissa bits wherever a value lands above 2^-6 of the scale's
range, so the headroom costs little precision); larger values saturate at 448 x scale.

The same text and forward (`calibration_tokens`, `calibration_forward`) calibrate the smoothing of FP8 weights
(model/smoothing.py).
"""

from __future__ import annotations

import torch

from prefixrt.cache.kv_pool import FP8_MAX, KVPool
from prefixrt.model.attention.torch_backend import TorchAttentionBackend
from prefixrt.model.base import CausalLM
from prefixrt.model.forward_batch import ForwardBatch

HEADROOM = 1.5
MAX_CALIBRATION_TOKENS = 512

CALIBRATION_TEXT = """\
The harbour town woke slowly. Fishing boats rocked against the pier while gulls argued over the remains of last \
night's catch, and the baker on Mill Street pulled the first loaves from an oven older than anyone in the village. \
By seven o'clock the market square was full: farmers unloaded crates of apples and potatoes, a woman sold honey in \
small glass jars, and two children chased a dog between the stalls.

Maria Santos had lived there for thirty-one years. She ran the small bookshop next to the post office, a narrow \
room whose shelves reached the ceiling and whose ladder squeaked on every rung. "People think a bookshop is a quiet \
business," she liked to say, "but every book is a conversation waiting to happen." On Tuesdays she hosted a reading \
group; on Fridays she taught evening classes in Spanish and Portuguese.

In 2019 the council proposed building a new road along the coast. The plan promised faster deliveries, 400 new \
parking spaces, and a reduction of travel time to the city from 95 minutes to about 50. Critics worried about the \
salt marshes north of the town, where herons nest each spring. After three public meetings, a survey of 1,250 \
residents, and a report by an independent engineer, the council chose a shorter route inland.

Science offers a useful way to think about such choices. A hypothesis is tested against evidence; if the evidence \
disagrees, the hypothesis must change. Water boils at 100 degrees Celsius at sea level, but at lower pressure, high \
in the mountains, it boils at a lower temperature. Plants convert sunlight, water and carbon dioxide into sugar and \
oxygen, a process called photosynthesis.

def average(values):
    \"\"\"Return the arithmetic mean of a non-empty list of numbers.\"\"\"
    return sum(values) / len(values)

Questions remain, of course. How should a small community balance growth against the things that make it worth \
living in? Who decides, and on what evidence? Maria's answer was simple: read widely, listen carefully, and change \
your mind when the facts require it. Then she unlocked the shop, turned the sign to OPEN, and put the kettle on.
"""


def calibration_tokens(tokenizer, max_tokens: int = MAX_CALIBRATION_TOKENS) -> list[int]:
    """CALIBRATION_TEXT as token ids (the tokenizer's special prefix included, as prompts have it), at most max_tokens.
    Without a tokenizer: fixed pseudo-random ids."""
    if tokenizer is None:
        gen = torch.Generator().manual_seed(0)
        return torch.randint(0, 1000, (max_tokens // 2,), generator=gen).tolist()
    return list(tokenizer.encode(CALIBRATION_TEXT))[:max_tokens]


@torch.no_grad()
def calibration_forward(model: CausalLM, token_ids: list[int], device: torch.device | str) -> KVPool:
    """One prefill of token_ids through the model's torch path into a temporary float32 pool on `device`, which it
    returns (slot p + 1 holds position p's K/V; slot 0 is padding). Token ids at or past the vocabulary are dropped,
    and at most the model's context is used. The model is left as it was; hooks on its modules see the forward
    (model/smoothing.py collects its linears' inputs this way)."""
    ids = [t for t in token_ids if 0 <= t < model.vocab_size][: model.max_context]
    if not ids:
        raise ValueError("calibration needs at least one token id inside the vocabulary")
    n = len(ids)
    pool = KVPool(n + 1, model.num_layers, model.num_kv_heads, model.head_dim, torch.float32, device)
    table = torch.arange(n + 1, dtype=torch.int32, device=device)[None, :]  # one row: position p -> slot p + 1
    batch = ForwardBatch.build(req_pool_indices=[0], prefix_lens=[0], extend_tokens=[ids],
                               out_cache_loc=list(range(1, n + 1)), req_to_token=table[:, 1:].contiguous(),
                               logits_indices=[n - 1], device=device)
    attn = TorchAttentionBackend(pool)
    attn.prepare(batch)
    model(batch, attn)
    return pool


@torch.no_grad()
def calibrate_kv_scales(model: CausalLM, token_ids: list[int], device: torch.device | str,
                        headroom: float = HEADROOM) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(k_scales, v_scales) [num_layers, num_kv_heads] float32 on `device` from one forward of token_ids
    (calibration_forward; see the module docstring). The model and every other pool are left as they were."""
    pool = calibration_forward(model, token_ids, device)
    k = pool.k_all[:, 1:]  # [L, n, KVH, D]
    v = pool.v_all[:, 1:]
    half = model.head_dim // 2
    pair_norm = (k[..., :half].square() + k[..., half:].square()).sqrt()  # [L, n, KVH, D/2]: RoPE-invariant
    k_amax = pair_norm.amax(dim=(1, 3))  # [L, KVH]
    v_amax = v.abs().amax(dim=(1, 3))
    floor = torch.finfo(torch.float32).tiny * FP8_MAX
    return (k_amax * headroom / FP8_MAX).clamp_min(floor), (v_amax * headroom / FP8_MAX).clamp_min(floor)


def set_kv_scales(pool: KVPool, model: CausalLM, tokenizer, say=None) -> None:
    """Give an FP8 pool its scales: the checkpoint's (model.kv_cache_scales) if it has them, else calibrated on
    CALIBRATION_TEXT. Mutates the pool's scales only."""
    if model.kv_cache_scales is not None:
        k, v = model.kv_cache_scales
        pool.set_scales(k.to(pool.device), v.to(pool.device), "checkpoint")
    else:
        k, v = calibrate_kv_scales(model, calibration_tokens(tokenizer), pool.device)
        pool.set_scales(k, v, "calibrated")
    if say is not None:
        say(f"FP8 K/V cache: scales {pool.scales_source} (K {pool.k_scales.min().item():.3g}.."
            f"{pool.k_scales.max().item():.3g}, V {pool.v_scales.min().item():.3g}..{pool.v_scales.max().item():.3g})")
