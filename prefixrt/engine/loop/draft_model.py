"""The draft-model drafter (EngineConfig.speculative="draft:MODEL"): a small model of the target's vocabulary
proposes k tokens greedily, one forward per token.

Its K/V lives in a second pool with the target pool's slot count, at the SAME slots: one allocator, one
request table, one radix tree for both models. Every target forward is mirrored (mirror(): the draft model runs
over the same tokens, positions and slots), so wherever the target pool holds a token's K/V the draft pool
holds the draft's K/V of that token too, and a prefix the tree caches for the target is cached for the draft:
a cache hit skips the prefix for both models. Eviction frees slots of both pools at once (they are the same
slots). Nothing else writes the pool of a draft engine: the host tier, tensor parallelism, image models and
a disaggregated decode engine are refused at build (their K/V arrives by copy, not by a forward).

propose_in_slots(): the rows' last tokens and k draft slots are allocated already (Speculator.plan); draft
step j runs the row's token at position base - 1 + j (its last token, then the drafts so far) into the slot
of that position and takes the argmax as draft j + 1. The target's verify forward that follows is mirrored
too: it rewrites those slots with the same K/V and writes the last draft's. Accepted drafts keep the draft
K/V of exactly the tokens they hold; rejected slots are freed with the target's (KVManager.truncate), and the
bonus token is run by the draft as the first step of the next round. Drafts are point masses: verification
keeps the target's outputs whatever the draft proposes (speculate.py).
"""

from __future__ import annotations

import dataclasses

import torch

from prefixrt.model.forward_batch import ForwardBatch
from prefixrt.request import Req
from prefixrt.speculative.drafter import Drafter


class DraftModelDrafter(Drafter):
    name = "draft"

    def __init__(self, runner, kv, device: torch.device):
        self.runner = runner  # ModelRunner of the draft model over its own pool (same slot count as the target's)
        self.kv = kv  # the engine's KVManager: the table and slots the draft shares
        self.device = device
        self.mirrored_tokens = 0  # tokens the draft ran alongside target forwards (a cache hit skips them)
        self.draft_forwards = 0  # the draft's own forwards (one per drafted position of a step)

    def propose(self, req: Req, k: int, cache=None) -> list[int]:
        raise NotImplementedError("the draft model drafts in the rows' slots: propose_in_slots")

    def mirror(self, fb: ForwardBatch) -> None:
        """Run the draft model over a target forward's tokens and slots (its K/V into the draft pool)."""
        mirrored = dataclasses.replace(fb, logits_indices=fb.logits_indices[-1:], prefix_groups=None,
                                       extend_plan=None, cascade_plan=None, kv_ready=None, mm=None)
        self.runner.forward(mirrored)
        self.mirrored_tokens += fb.num_tokens

    def propose_in_slots(self, rows: list[tuple[Req, int, list[int]]]) -> list[list[int]]:
        """rows: (request, k, slots) with slots[0] the slot of the request's last token (not yet computed) and
        slots[1:] its k draft slots, all written in its table row. Returns each row's k greedy drafts."""
        out: list[list[int]] = [[] for _ in rows]
        steps = max((k for _, k, _ in rows), default=0)
        self.kv.table.flush()
        for j in range(steps):
            active = [i for i, (_, k, _) in enumerate(rows) if k > j]
            reqs = [rows[i][0] for i in active]
            fb = ForwardBatch.build(
                req_pool_indices=[r.row for r in reqs],
                prefix_lens=[len(r.all_ids) - 1 + j for r in reqs],
                extend_tokens=[[out[i][j - 1] if j else rows[i][0].all_ids[-1]] for i in active],
                out_cache_loc=[rows[i][2][j] for i in active],
                req_to_token=self.kv.table.table,
                logits_indices=list(range(len(active))),
                device=self.device,
            )
            toks = self.runner.forward(fb).argmax(dim=-1).tolist()
            self.draft_forwards += 1
            for i, t in zip(active, toks):
                out[i].append(int(t))
        return out


def check_draft_model(target, draft, config) -> None:
    """Refuse a draft model the engine cannot pair with the target (ValueError): another vocabulary, or a
    configuration whose K/V reaches the pool other than by a forward (disagg/decode.py refuses its own case)."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft.vocab_size} ids) differs from the target's "
                         f"({target.vocab_size}): a draft model must share the target's tokenizer")
    if getattr(target, "vision", None) is not None:
        raise ValueError("a draft model cannot serve an image model (image tokens have no draft K/V)")
    if config.host_kv_cache_tokens:
        raise ValueError("a draft model needs host_kv_cache_tokens=0 (the host tier would copy the target's K/V only)")
    if config.tp_size != 1:
        raise ValueError("a draft model runs on one device (tp=1)")
