"""Layer-split K/V for context-parallel prefill: W ranks run one long sequence together.

Status: experimental. Correct on the CPU (tests/parallel/test_layer_split.py) but not part of the engine: no
EngineConfig option reaches it, and it runs one sequence through LayerSplitRunner, with no scheduler, radix
cache or CUDA graphs. What wiring it in would need is in docs/layer_split.md ("Status").

Compute is split by tokens: rank r computes the r-th contiguous chunk of each forward's new tokens (every layer,
every head). K/V storage is split by layer: the K/V of layer l — the cached prefix and everything computed
since — lives on rank `owner(l) = l % W` alone, so each rank stores 1/W of the sequence's K/V instead of all of
it. Every rank's queries need layer l's whole prefix, so just before layer l's attention its owner broadcasts
the layer's K/V to the other ranks; the broadcast of layer l+1 is started (asynchronously) when layer l starts,
so it travels while layer l computes. The new tokens' K/V of a layer is all-gathered (a chunk's queries attend to
the earlier chunks' keys) and the owner appends it to its store. docs/layer_split.md models the memory saved and
the broadcast volume against replicating every layer's K/V; benchmarks/layer_split_model.py computes its table.

Contracts (the order of collectives is the same on every rank, so every rank issues the same sequence):
- wait(l) (called by the model before layer l, through ForwardBatch.kv_ready) returns only once layer l's
  prefix is on this rank, and has issued the broadcast of layer l+1 before layer l's compute starts.
- A rank reads a layer's store only while no broadcast of that layer is in flight (the owner appends after the
  layer's broadcast completed, in forward(); the next broadcast of it is issued at the next forward).
- Replicated steps (decode: one token, computed by every rank) skip the all-gather; the prefix is still
  broadcast per layer, which is why decode belongs on a decode engine (disagg/decode.py), not here.
The model and its layers are unchanged: this is an AttentionBackend plus the per-layer wait hook.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from prefixrt.model.attention.base import AttentionBackend, AttentionLayer
from prefixrt.model.base import CausalLM
from prefixrt.model.forward_batch import ForwardBatch


def owner(layer: int, world_size: int) -> int:
    return layer % world_size


def chunk_bounds(num_tokens: int, world_size: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) of each rank's new tokens (sizes differ by at most one; some may be empty)."""
    base, extra = divmod(num_tokens, world_size)
    out, start = [], 0
    for r in range(world_size):
        end = start + base + (r < extra)
        out.append((start, end))
        start = end
    return out


@dataclass
class _Step:
    """One forward of the sequence on this rank."""

    prefix_len: int  # tokens with K/V before this forward (on every rank's books)
    bounds: list[tuple[int, int]]  # each rank's [start, end) of the new tokens; all equal when replicated
    replicated: bool
    prefix: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [2, prefix_len, kvh, d] on this rank
    inflight: dict[int, tuple[object, torch.Tensor]] = field(default_factory=dict)  # layer -> (work, buffer)
    log: list[tuple[str, int]] = field(default_factory=list)  # ("broadcast", l) / ("attend", l): issue order


class LayerSplitKV:
    """This rank's layers' K/V of one sequence, and the collectives that give every rank what a layer needs.

    kv[l] ([2, length, kvh, d]) exists only for layers this rank owns. `length` is the same on every rank."""

    def __init__(self, group, rank: int, world_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype):
        self.group, self.rank, self.world_size = group, rank, world_size
        self.num_layers, self.num_kv_heads, self.head_dim, self.dtype = num_layers, num_kv_heads, head_dim, dtype
        self.kv: dict[int, torch.Tensor] = {
            layer: torch.empty((2, 0, num_kv_heads, head_dim), dtype=dtype)
            for layer in range(num_layers) if owner(layer, world_size) == rank
        }
        self.length = 0
        self.step: _Step | None = None
        self.bytes_stored_peak = 0
        self.bytes_broadcast = 0  # received by this rank: prefixes of layers it does not own
        self.bytes_gathered = 0  # received by this rank: other ranks' new K/V

    @property
    def bytes_stored(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv.values())

    # ------------------------------------------------------------------ the per-layer hook (kv_ready)
    def begin(self, num_new: int, replicated: bool) -> tuple[int, int]:
        """Start a forward of num_new tokens; returns this rank's [start, end) of them."""
        bounds = [(0, num_new)] * self.world_size if replicated else chunk_bounds(num_new, self.world_size)
        self.step = _Step(self.length, bounds, replicated)
        return bounds[self.rank]

    def wait(self, layer: int) -> None:
        """Before layer `layer`: its prefix is here when this returns; the next layer's broadcast is on its way."""
        step = self.step
        if layer == 0:
            self._issue(0)
        if layer + 1 < self.num_layers:
            self._issue(layer + 1)  # travels while this layer computes
        work, buf = step.inflight.pop(layer, (None, None))
        if work is not None:
            work.wait()
            step.prefix[layer] = buf

    def wait_all(self) -> None:
        for layer in range(self.num_layers):
            self.wait(layer)

    def _issue(self, layer: int) -> None:
        step = self.step
        if layer in step.inflight or layer in step.prefix or step.prefix_len == 0:
            return
        root = owner(layer, self.world_size)
        if root == self.rank:
            buf = self.kv[layer]
            step.prefix[layer] = buf
        else:
            buf = torch.empty((2, step.prefix_len, self.num_kv_heads, self.head_dim), dtype=self.dtype)
            self.bytes_broadcast += buf.numel() * buf.element_size()
        step.inflight[layer] = (self.group.broadcast(buf, root), buf)
        step.log.append(("broadcast", layer))

    # ------------------------------------------------------------------ the new tokens of a layer
    def gather_new(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Every rank's new K/V of this layer in token order: [2, num_new, kvh, d] (k, v: this rank's
        [t, kvh, d]). The owner appends it to its store."""
        step = self.step
        mine = torch.stack((k, v)).to(self.dtype)  # [2, t, kvh, d]
        if step.replicated:
            new = mine
        else:
            tmax = max(e - s for s, e in step.bounds)
            pad = mine.new_zeros((2, tmax, self.num_kv_heads, self.head_dim))
            pad[:, : mine.shape[1]] = mine
            outs = [torch.empty_like(pad) for _ in range(self.world_size)]
            self.group.allgather([outs], [pad]).wait()
            new = torch.cat([o[:, : e - s] for o, (s, e) in zip(outs, step.bounds)], dim=1)
            self.bytes_gathered += sum(o.numel() * o.element_size() for i, o in enumerate(outs) if i != self.rank)
        if owner(layer, self.world_size) == self.rank:
            self.kv[layer] = torch.cat((self.kv[layer], new), dim=1)
        step.log.append(("attend", layer))
        return new

    def end(self) -> None:
        step, self.step = self.step, None
        assert not step.inflight, f"layers {sorted(step.inflight)} were broadcast but never waited for"
        self.length += step.bounds[-1][1] if not step.replicated else step.bounds[0][1]
        self.bytes_stored_peak = max(self.bytes_stored_peak, self.bytes_stored)


class LayerSplitAttention(AttentionBackend):
    """Dense attention of this rank's new tokens over [the layer's prefix, every rank's new tokens] (fp32
    scores, as the torch reference backend), causal, windowed, soft-capped, GQA."""

    def __init__(self, kv: LayerSplitKV):
        self.kv = kv
        self.pool = None  # no paged pool: the fused K/V store path is not used here

    def close(self) -> None:
        pass  # the K/V lives in LayerSplitKV, whose owner drops it

    def prepare(self, batch: ForwardBatch) -> None:
        return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
                batch: ForwardBatch) -> torch.Tensor:  # q: [t, h*d]; k, v: [t, kvh*d] -> [t, h*d]
        if k is None:
            raise RuntimeError("layer-split attention needs the unfused path (k and v from the model)")
        st = self.kv.step
        t = q.shape[0]
        h, kvh, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        new = self.kv.gather_new(layer.layer_id, k.view(t, kvh, d), v.view(t, kvh, d))  # [2, T, kvh, d]
        prefix = st.prefix.get(layer.layer_id)
        keys = new if prefix is None else torch.cat((prefix, new), dim=1)  # [2, S, kvh, d], S = P + T
        if t == 0:
            return q.new_zeros((0, h * d))
        start = st.bounds[self.kv.rank][0]
        q_pos = torch.arange(st.prefix_len + start, st.prefix_len + start + t)[:, None]  # [t, 1]
        k_pos = torch.arange(keys.shape[1])[None, :]  # [1, S]
        mask = k_pos <= q_pos
        if layer.sliding_window is not None:
            mask &= k_pos > q_pos - layer.sliding_window
        group = h // kvh
        qi = q.view(t, kvh, group, d).float().permute(1, 2, 0, 3)  # [kvh, group, t, d]
        ki = keys[0].float().permute(1, 0, 2)[:, None]  # [kvh, 1, S, d]
        vi = keys[1].float().permute(1, 0, 2)[:, None]
        scores = (qi @ ki.transpose(-1, -2)) * layer.scaling  # [kvh, group, t, S]
        if layer.logit_softcap is not None:
            scores = torch.tanh(scores / layer.logit_softcap) * layer.logit_softcap
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        out = probs @ vi  # [kvh, group, t, d]
        return out.permute(2, 0, 1, 3).reshape(t, h * d).to(q.dtype)


class LayerSplitRunner:
    """One rank of a context-parallel run of one sequence over a model (every rank holds the full weights).

    extend(tokens) runs new tokens split across the ranks (prefill, or a later turn reusing the cached prefix)
    and returns the last token's logits on every rank; step(token) runs one token replicated (decode);
    generate(prompt, n) is greedy decoding over both. Call the same methods in the same order on every rank."""

    def __init__(self, model: CausalLM, group, rank: int, world_size: int):
        self.model = model
        self.group, self.rank, self.world_size = group, rank, world_size
        first = model.attention_layers[0]
        dtype = next(model.parameters()).dtype
        self.kv = LayerSplitKV(group, rank, world_size, model.num_layers, first.num_kv_heads, first.head_dim, dtype)
        self.attn = LayerSplitAttention(self.kv)
        self.logs: list[list[tuple[str, int]]] = []  # each forward's issue order (tests check the overlap)

    def extend(self, tokens: list[int]) -> torch.Tensor:
        """Tokens appended to the sequence, computed split across ranks. Returns [vocab] float32 logits of the
        last one (broadcast from the rank that computed it)."""
        return self._forward(tokens, replicated=False)

    def step(self, token: int) -> torch.Tensor:
        return self._forward([token], replicated=True)

    def generate(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        logits = self.extend(prompt)
        out = []
        for i in range(max_new_tokens):
            tok = int(torch.argmax(logits))
            out.append(tok)
            if i + 1 < max_new_tokens:
                logits = self.step(tok)
        return out

    def _forward(self, tokens: list[int], replicated: bool) -> torch.Tensor:
        start, end = self.kv.begin(len(tokens), replicated)
        mine = tokens[start:end]
        prefix = self.kv.length + start
        batch = ForwardBatch.build(
            req_pool_indices=[0], prefix_lens=[prefix], extend_tokens=[mine], out_cache_loc=[0] * len(mine),
            req_to_token=torch.zeros((1, 1), dtype=torch.int32), logits_indices=[len(mine) - 1] if mine else [],
            device="cpu",
        )
        batch.kv_ready = self.kv
        with torch.inference_mode():
            logits = self.model(batch, self.attn)  # [0 or 1, vocab]
        self.logs.append(list(self.kv.step.log))
        self.kv.end()
        if replicated:
            return logits[0]
        last = max(r for r, (s, e) in enumerate(chunk_bounds(len(tokens), self.world_size)) if e > s)
        out = logits[0].clone() if self.rank == last else torch.empty(self.model.vocab_size, dtype=torch.float32)
        self.group.broadcast(out, last).wait()
        return out
