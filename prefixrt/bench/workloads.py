"""Token-level benchmark workloads (docs/design.md): prompts are token ids, outputs have fixed lengths
(ignore_eos), so they run with dummy weights and any tokenizer.

A workload is a list of sessions; a session is a list of turns run one after another (a turn's prompt may
extend the previous turn's prompt and output). Single-turn workloads have one turn per session.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Turn:
    new_tokens: list[int]  # appended to the session's history (previous prompts + outputs) to form the prompt
    max_new_tokens: int


@dataclass
class Workload:
    name: str
    sessions: list[list[Turn]]
    description: str = ""
    params: dict = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return sum(len(s) for s in self.sessions)


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    # Skip the lowest ids: they are special tokens (pad/bos/eos) in most vocabularies.
    return [rng.randrange(16, vocab) for _ in range(n)]


def shared_prefix(vocab: int, groups: int = 64, prompts_per_group: int = 16, system_len: int = 2048,
                  question_len: int = 128, output_len: int = 256, seed: int = 0) -> Workload:
    """G groups x P prompts: a group's prompts share a system prefix of S tokens, then Q unique tokens."""
    rng = random.Random(seed)
    sessions = []
    for _ in range(groups):
        system = _ids(rng, system_len, vocab)
        for _ in range(prompts_per_group):
            sessions.append([Turn(system + _ids(rng, question_len, vocab), output_len)])
    rng.shuffle(sessions)
    return Workload("shared-prefix", sessions, f"{groups}x{prompts_per_group} groups, {system_len} shared + "
                    f"{question_len} unique, {output_len} out",
                    dict(groups=groups, prompts_per_group=prompts_per_group, system_len=system_len,
                         question_len=question_len, output_len=output_len))


def rag(vocab: int, requests: int = 64, shared_len: int = 3500, unique_len: int = 80, output_len: int = 200,
        seed: int = 0) -> Workload:
    """One document block shared by every request (RAG): the shared-prefix case with one group."""
    w = shared_prefix(vocab, 1, requests, shared_len, unique_len, output_len, seed)
    w.name = "rag"
    w.description = f"{requests} requests, {shared_len} shared + {unique_len} unique, {output_len} out"
    return w


def random_prompts(vocab: int, requests: int = 256, input_len: int = 1024, output_len: int = 256,
                   seed: int = 0) -> Workload:
    """No reuse at all: measures the radix cache's overhead."""
    rng = random.Random(seed)
    sessions = [[Turn(_ids(rng, input_len, vocab), output_len)] for _ in range(requests)]
    return Workload("random", sessions, f"{requests} prompts, {input_len} in, {output_len} out",
                    dict(requests=requests, input_len=input_len, output_len=output_len))


def multi_turn(vocab: int, sessions: int = 32, turns: int = 4, min_append: int = 256, max_append: int = 512,
               output_len: int = 64, seed: int = 0) -> Workload:
    """Chat sessions: each turn appends 256-512 new tokens to the whole history (prompts and outputs)."""
    rng = random.Random(seed)
    out = [[Turn(_ids(rng, rng.randint(min_append, max_append), vocab), output_len) for _ in range(turns)]
           for _ in range(sessions)]
    return Workload("multi-turn", out, f"{sessions} sessions x {turns} turns, +{min_append}-{max_append} "
                    f"tokens a turn, {output_len} out",
                    dict(sessions=sessions, turns=turns, output_len=output_len))


def long_context(vocab: int, sessions: int = 4, turns: int = 8, append_len: int = 4000, output_len: int = 32,
                 seed: int = 0) -> Workload:
    """Long multi-turn sessions (documents pasted turn after turn): each turn appends append_len tokens to
    the whole history, so with the defaults the last prompt of a session is past 32k tokens. Every turn
    reuses the session's cached history and computes only what it appended: the workload measures the
    throughput of computed (uncached) prompt tokens at long context (see compute_floor)."""
    rng = random.Random(seed)
    out = [[Turn(_ids(rng, append_len, vocab), output_len) for _ in range(turns)] for _ in range(sessions)]
    final = turns * append_len + (turns - 1) * output_len
    return Workload("long-context", out, f"{sessions} sessions x {turns} turns, +{append_len} tokens a turn "
                    f"(last prompt {final} tokens), {output_len} out",
                    dict(sessions=sessions, turns=turns, append_len=append_len, output_len=output_len))


def agent(vocab: int, sessions: int = 16, turns: int = 6, shared_len: int = 16384, own_len: int = 8192,
          append_len: int = 2048, output_len: int = 64, seed: int = 0) -> Workload:
    """Coding agents over one repository: every session starts from the same shared context (system prompt,
    tools, the repository map: shared_len tokens) plus its own (the task and the files it opened: own_len), and
    each later turn appends a tool result (append_len) to the whole history. All sessions run at once, so
    with a pool smaller than the working set (working_set_tokens) the running sessions' histories compete
    for it: the regime of issue-tracker agents with long, highly reused contexts."""
    rng = random.Random(seed)
    shared = _ids(rng, shared_len, vocab)
    out = []
    for _ in range(sessions):
        first = Turn(shared + _ids(rng, own_len, vocab), output_len)
        out.append([first] + [Turn(_ids(rng, append_len, vocab), output_len) for _ in range(turns - 1)])
    last = shared_len + own_len + (turns - 1) * (append_len + output_len)
    return Workload("agent", out, f"{sessions} sessions x {turns} turns, {shared_len} shared + {own_len} own, "
                    f"+{append_len} a turn (last prompt {last} tokens), {output_len} out",
                    dict(sessions=sessions, turns=turns, shared_len=shared_len, own_len=own_len,
                         append_len=append_len, output_len=output_len))


def working_set_tokens(w: Workload) -> int:
    """Tokens of K/V that keep every session's whole history (prompts and outputs) cached at once, a prefix
    shared by several sessions counted once: the pool an unbounded run needs."""
    histories = []
    for s in w.sessions:
        history: list[int] = []
        for turn in s:
            history = history + turn.new_tokens + [-1 - len(history)] * turn.max_new_tokens  # outputs: unique
        histories.append(history)
    return _distinct_prefix_tokens(histories)


def optimal_hit_rate(prompts: list[list[int]]) -> float:
    """Cache hit rate of an ideal cache that keeps everything: every distinct prefix computed once."""
    total = sum(len(p) for p in prompts)
    return (total - _distinct_prefix_tokens(prompts)) / total if total else 0.0


def _distinct_prefix_tokens(sequences: list[list[int]]) -> int:
    """Tokens of the sequences with each shared prefix counted once: the nodes of their token trie."""
    trie: dict = {}
    nodes = 0
    for seq in sequences:
        cur = trie
        for t in seq:
            nxt = cur.get(t)
            if nxt is None:
                nxt = cur[t] = {}
                nodes += 1
            cur = nxt
    return nodes


def ideal_hit_rate(requests: list[tuple[list[int], list[int], int]]) -> float:
    """Hit rate of an ideal cache over a request trace in submission order: each request (prompt ids, output ids,
    reuse cap) reuses the longest prefix of its prompt that any earlier request computed (its prompt, or its
    prompt plus all but the last of its output tokens, whose K/V an engine computes while decoding), at most
    `reuse cap` tokens (an engine recomputes at least the last prompt token). A cache that never evicts and
    matches token by token reaches it; the offline optimum of the paper's hit-rate comparison."""
    hits, total, _ = _ideal_cache(requests)
    return hits / total if total else 0.0


def trace_working_set(requests: list[tuple[list[int], list[int], int]]) -> int:
    """Tokens the ideal cache of ideal_hit_rate holds at the end of the trace: the distinct prefixes (a token
    each) that its requests computed. A KV pool of fewer tokens must evict before the trace ends."""
    return _ideal_cache(requests)[2]


def _ideal_cache(requests) -> tuple[int, int, int]:
    """(prompt tokens reused, prompt tokens, tokens held) of the never-evicting token trie over the trace."""
    trie: dict = {}
    hits = total = held = 0
    for prompt, output, cap in requests:
        total += len(prompt)
        node, depth = trie, 0
        for t in prompt:
            nxt = node.get(t)
            if nxt is None:
                break
            node, depth = nxt, depth + 1
        hits += max(0, min(depth, cap))
        for t in (prompt + output[:-1])[depth:]:
            nxt = node.get(t)
            if nxt is None:
                nxt = node[t] = {}
                held += 1
            node = nxt
    return hits, total, held
