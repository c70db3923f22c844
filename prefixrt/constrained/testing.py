"""Test helpers for constrained decoding: a random constrained sampler and mask inspection.

Used by tests and by benchmarks to drive a matcher without a model (the "model" picks a random allowed
token), checking the Matcher contract at every step.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from prefixrt.constrained.base import CompiledGrammar, GrammarBackend, Matcher
from prefixrt.constrained.logits import allocate_bitmask, unpack_bitmask

_CLOSERS = set('"}]),;')
_CLOSER_MASKS: dict[tuple[int, int], torch.Tensor] = {}


def _closer_mask(texts: list[str], vocab_size: int) -> torch.Tensor:
    """bool [vocab_size]: tokens containing closing punctuation (cached per token-text list)."""
    key = (id(texts), vocab_size)
    if key not in _CLOSER_MASKS:
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[[i for i, t in enumerate(texts) if _CLOSERS & set(t)]] = True
        _CLOSER_MASKS[key] = mask
    return _CLOSER_MASKS[key]


@dataclass
class Walk:
    ids: list[int] = field(default_factory=list)  # generated ids, EOS excluded
    forced_runs: list[tuple[int, list[int]]] = field(default_factory=list)  # (start index, tokens)
    num_forced: int = 0
    num_sampled: int = 0
    finished: bool = False
    stopped_by_eos: bool = False


def random_walk(backend: GrammarBackend, compiled: CompiledGrammar, texts: list[str], seed: int, max_tokens: int = 300,
                p_eos: float = 0.5, p_closer: float = 0.5, matcher: Matcher | None = None,
                prefer_open: str = "") -> Walk:
    """Generate under the grammar with a random sampler: each step follows forced tokens when there are
    any, else picks a random allowed token (biased towards EOS and closing punctuation so walks end).

    texts: the decoded text of every tokenizer id (`tokenizer.batch_decode([[i] for i in range(n)])`).
    matcher: the matcher to drive (default: a fresh `backend.matcher(compiled)`).
    prefer_open: characters the sampler never picks while the grammar allows a token without them (with
    p_eos = p_closer = 0 and `"]}\n,`: a model that never ends a value by choice, only where it must).
    Asserts the contract on the way: the mask is never empty, every masked-in token is accepted, and
    padding ids are never allowed.
    """
    rng = random.Random(seed)
    matcher = backend.matcher(compiled) if matcher is None else matcher
    bitmask = allocate_bitmask(1, backend.vocab_size)
    walk = Walk()
    eos = set(backend.eos_token_ids)
    eos_list = sorted(eos)
    while len(walk.ids) < max_tokens:
        if matcher.is_finished():
            walk.finished = True
            break
        forced = matcher.forced_tokens()
        if forced:
            assert not eos & set(forced)
            assert matcher.accept_tokens(forced) == len(forced)
            walk.forced_runs.append((len(walk.ids), forced))
            walk.ids += forced
            walk.num_forced += len(forced)
            continue
        matcher.fill_bitmask(bitmask, 0)
        allowed_mask = unpack_bitmask(bitmask, backend.vocab_size)[0]  # bool [V]
        allowed = allowed_mask.nonzero().flatten()  # int64 [num_allowed]
        assert allowed.numel() > 0, "empty mask before the matcher finished"
        assert int(allowed[-1]) < len(texts), "a padding id was allowed"
        stop_ids = [t for t in eos_list if allowed_mask[t]]
        assert bool(stop_ids) == matcher.can_stop()
        if stop_ids and rng.random() < p_eos:
            token = rng.choice(stop_ids)
        elif rng.random() < p_closer and (closers := (allowed_mask & _closer_mask(texts, backend.vocab_size)).nonzero()).numel():
            token = int(closers[rng.randrange(closers.numel())])
        else:
            if prefer_open:
                avoid = set(prefer_open)
                open_ids = [int(t) for t in allowed if int(t) not in eos and not avoid & set(texts[int(t)])]
                allowed = torch.tensor(open_ids) if open_ids else allowed
            token = int(allowed[rng.randrange(allowed.numel())])
        assert matcher.accept_token(token), f"masked-in token {token} {texts[token]!r} was rejected"
        walk.num_sampled += 1
        if token in eos:
            walk.stopped_by_eos = True
            assert matcher.is_finished()
            walk.finished = True
            break
        walk.ids.append(token)
    else:
        walk.finished = matcher.is_finished()
    return walk


def allowed_ids(matcher: Matcher, vocab_size: int) -> list[int]:
    bitmask = allocate_bitmask(1, vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    return unpack_bitmask(bitmask, vocab_size)[0].nonzero().flatten().tolist()


def mask_row(matcher: Matcher, vocab_size: int) -> torch.Tensor:
    bitmask = allocate_bitmask(1, vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    return bitmask[0].clone()
