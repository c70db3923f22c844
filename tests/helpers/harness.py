"""A minimal engine stand-in for model tests: drives a model over a paged KV pool the way the scheduler
will, without the scheduler.

Each sequence owns a row of req_to_token. Slots come from a shuffled free list (so a sequence's K/V is
scattered over the pool), and a new row may start with another row's prefix slots (what a radix-cache
hit does), so the model reads K/V that a different sequence wrote in an earlier forward.
"""

from __future__ import annotations

import random

import torch

from prefixrt.cache.kv_pool import KVPool
from prefixrt.model.attention.torch_backend import TorchAttentionBackend
from prefixrt.model.base import CausalLM
from prefixrt.model.forward_batch import ForwardBatch
from prefixrt.model.runner import ModelRunner


class PagedHarness:
    def __init__(
        self,
        model: CausalLM,
        *,
        num_slots: int = 1024,
        max_rows: int = 32,
        max_context: int = 128,
        seed: int = 0,
        device: torch.device | str = "cpu",
        kv_dtype: torch.dtype | None = None,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
        backend: str = "torch",
    ):
        """kv_dtype: the pool's storage dtype (default: the model's); an FP8 pool takes kv_scales ([layers, kv
        heads] each). backend: the attention backend, "torch" or "triton"."""
        dtype = kv_dtype or next(p.dtype for p in model.parameters() if p.dtype.itemsize > 1)
        self.device = torch.device(device)
        self.model = model
        self.pool = KVPool(num_slots, model.num_layers, model.num_kv_heads, model.head_dim, dtype, self.device)
        if kv_scales is not None:
            self.pool.set_scales(*kv_scales, source="given")
        if backend == "triton":
            from prefixrt.model.attention.triton_backend import TritonAttentionBackend

            attn = TritonAttentionBackend(self.pool)
        else:
            attn = TorchAttentionBackend(self.pool)
        self.runner = ModelRunner(model, self.pool, attn)
        self.req_to_token = torch.zeros(max_rows, max_context, dtype=torch.int32, device=self.device)
        self.free_slots = list(range(1, num_slots))  # slot 0 is the padding slot
        random.Random(seed).shuffle(self.free_slots)
        self.free_rows = list(range(max_rows))
        self.tokens: dict[int, list[int]] = {}  # row -> tokens whose K/V is in the pool

    def new_row(self, share_prefix_of: int | None = None, prefix_len: int = 0) -> int:
        """A new sequence; optionally starting with the first prefix_len cached tokens of another row."""
        row = self.free_rows.pop(0)
        self.tokens[row] = []
        if share_prefix_of is not None and prefix_len > 0:
            self.req_to_token[row, :prefix_len] = self.req_to_token[share_prefix_of, :prefix_len]
            self.tokens[row] = self.tokens[share_prefix_of][:prefix_len]
        return row

    def forward(self, work: list[tuple[int, list[int]]], all_logits: bool = True, mm=None) -> list[torch.Tensor]:
        """One forward over [(row, new tokens)]. Returns per sequence float32 CPU logits for every new
        token ([n_new, vocab]) or, with all_logits=False, for its last one ([1, vocab]). mm: a MultimodalBatch
        for the batch (image embeddings and blocks), or None."""
        rows, prefix_lens, extend_tokens, out_loc, logits_indices = [], [], [], [], []
        offset = 0
        for row, new_tokens in work:
            prefix_len = len(self.tokens[row])
            slots = [self.free_slots.pop() for _ in new_tokens]
            self.req_to_token[row, prefix_len : prefix_len + len(slots)] = torch.tensor(slots, dtype=torch.int32)
            rows.append(row)
            prefix_lens.append(prefix_len)
            extend_tokens.append(list(new_tokens))
            out_loc.extend(slots)
            first = offset if all_logits else offset + len(new_tokens) - 1
            logits_indices.extend(range(first, offset + len(new_tokens)))
            offset += len(new_tokens)
        batch = ForwardBatch.build(
            req_pool_indices=rows,
            prefix_lens=prefix_lens,
            extend_tokens=extend_tokens,
            out_cache_loc=out_loc,
            req_to_token=self.req_to_token,
            logits_indices=logits_indices,
            device=self.device,
        )
        batch.mm = mm
        logits = self.runner.forward(batch).cpu()  # [L, vocab]
        for row, new_tokens in work:
            self.tokens[row].extend(new_tokens)
        sizes = [len(t) if all_logits else 1 for t in extend_tokens]
        return list(logits.split(sizes))

    def best_cached_prefix(self, prompt: list[int]) -> tuple[int | None, int]:
        """(row, length) of the longest cached prefix of prompt, leaving at least one token to compute."""
        best_row, best_len = None, 0
        for row, toks in self.tokens.items():
            n = 0
            while n < min(len(toks), len(prompt) - 1) and toks[n] == prompt[n]:
                n += 1
            if n > best_len:
                best_row, best_len = row, n
        return best_row, best_len

    def generate_greedy(
        self, prompts: list[list[int]], max_new_tokens: int, prefill_batch: int = 3, stop_at_eos: bool = True
    ) -> list[list[int]]:
        """Greedy decoding: prompts prefilled prefill_batch at a time (reusing prefixes cached by earlier
        forwards), then all sequences decoded together. Stops a sequence at an eos token (unless not
        stop_at_eos)."""
        rows, pending = [], []  # pending: first generated token of each row
        for start in range(0, len(prompts), prefill_batch):
            work = []
            for prompt in prompts[start : start + prefill_batch]:
                src, cached = self.best_cached_prefix(prompt)
                row = self.new_row(src, cached)
                rows.append(row)
                work.append((row, prompt[cached:]))
            for logits in self.forward(work, all_logits=False):
                pending.append(int(logits[-1].argmax()))
        outputs: list[list[int]] = [[t] for t in pending]
        eos = set(self.model.eos_token_ids) if stop_at_eos else set()
        for _ in range(max_new_tokens - 1):
            live = [i for i, out in enumerate(outputs) if out[-1] not in eos]
            if not live:
                break
            logits = self.forward([(rows[i], [outputs[i][-1]]) for i in live], all_logits=False)
            for i, lg in zip(live, logits):
                outputs[i].append(int(lg[-1].argmax()))
        return outputs
