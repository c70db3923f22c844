"""Tensor parallelism on the CPU: two gloo ranks (rank 0 here, rank 1 a spawned process) against one rank and
against transformers, on the tiny checkpoint of every model class (Llama, Mistral, Qwen2, Qwen3, Gemma-3).

One TP=2 engine per architecture runs every check, to keep the start-ups (a spawned process importing torch)
few: greedy tokens equal to transformers' `generate` and to a TP=1 engine with the same options, one by one
(cache hits) and batched on a pool small enough to evict and retract; prefill and decode logits within 1e-5 of
the TP=1 engine's and of transformers' (fp32); an abort mid-stream leaves the ranks in step; shutdown ends rank 1 cleanly.
For Qwen2, rank 1 runs as a second node (`prefixrt serve --nnodes 2 --node-rank 1 --dist-init-addr ...`).
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.engine.test_oracle import _prompts
from tests.helpers.engines import assert_idle_and_clean

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma3")  # every model class in prefixrt/model
TWO_NODES = ("qwen2",)  # rank 1 as a second "node" (--nnodes 2 --node-rank 1 --dist-init-addr) on this machine
ONE_KV_HEAD = ("mistral",)  # a checkpoint with 1 KV head: each rank holds it (replicated), 2 query heads each
REPO = Path(__file__).resolve().parents[2]
POOL = dict(kv_cache_tokens=320, chunked_prefill_tokens=16, debug=True)
GREEDY = {"temperature": 0, "ignore_eos": True}


def _tree_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts sharing prefixes at random depths (a radix tree's worth of branching)."""
    rng = random.Random(seed)
    roots = [[1] + [rng.randrange(3, 320) for _ in range(rng.randint(8, 30))] for _ in range(4)]
    out = []
    for _ in range(n):
        p = list(rng.choice(roots))
        p = p[: rng.randint(1, len(p))] + [rng.randrange(3, 320) for _ in range(rng.randint(1, 10))]
        out.append(p[:60])
    return out


@torch.no_grad()
def _hf_greedy(hf, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy continuations: the argmax of its logits, one forward over all sequences per token.
    Sequences are padded on the right, which no real position attends to (causal), so no mask is needed; for
    these tiny models this is far quicker than a `generate` call per prompt, with the same tokens."""
    seqs = [list(p) for p in prompts]
    for _ in range(n):
        width = max(map(len, seqs))
        ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
        logits = hf(ids).logits  # [B, width, vocab]
        for i, s in enumerate(seqs):
            s.append(int(logits[i, len(s) - 1].argmax()))
    return [s[len(p):] for s, p in zip(seqs, prompts)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _folder_with_tokenizer(folder, checkpoint, tokenizer):
    """A tiny checkpoint plus the tiny tokenizer's files: what Engine(path) loads on every rank."""
    folder.mkdir()
    for f in checkpoint.iterdir():
        (folder / f.name).symlink_to(f)
    tokenizer.save_pretrained(str(folder))
    return folder


def _record_logits(engine) -> list[torch.Tensor]:
    """Every forward's logits on rank 0 from now on (the runner's output: before sampling)."""
    runner, seen = engine.core.runner, []
    forward = runner.forward

    def recording(batch):
        logits = forward(batch)
        seen.append(logits.detach().clone())
        return logits

    runner.forward = recording
    return seen


def _logits_of(engine, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """A cold greedy run of prompt: (its tokens, the logits that chose them [n, vocab]: the prefill's last
    position, then each decode step)."""
    engine.flush_cache()
    seen = _record_logits(engine)
    try:
        tokens = engine.generate(prompt, {"max_new_tokens": n, **GREEDY}).token_ids
    finally:
        del engine.core.runner.forward
    chunks = math.ceil(len(prompt) / POOL["chunked_prefill_tokens"])
    steps = seen[chunks - 1: chunks - 1 + n]  # later ones (overlap: a stale last forward) are not the request's
    return tokens, torch.cat(steps)


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_equals_tp1_and_transformers(arch, tmp_path, tiny_checkpoints, tiny_tokenizer, underestimated_decode):
    from prefixrt.engine.engine import Engine
    from tests.helpers.checkpoints import build_hf_model

    if arch in ONE_KV_HEAD:
        hf = build_hf_model(arch, num_key_value_heads=1)
        checkpoint = tmp_path / "checkpoint"
        hf.save_pretrained(str(checkpoint))
    else:
        checkpoint, hf = tiny_checkpoints(arch)
    folder = _folder_with_tokenizer(tmp_path / "folder", checkpoint, tiny_tokenizer)
    oracle_prompts, tree_prompts = _prompts(), _tree_prompts(24, seed=7)
    # The overlapped loop on rank 0 (CUDA's default): step N+1's input ids come from step N's device tokens.
    kwargs = dict(device="cpu", tp_size=2, overlap_schedule=True, **POOL)
    node1 = None
    if arch in TWO_NODES:  # rank 1 on "node 1": `prefixrt serve --node-rank 1`, meeting rank 0 at dist_init_addr
        addr = f"127.0.0.1:{_free_port()}"
        kwargs.update(nnodes=2, node_rank=0, dist_init_addr=addr)
        node1 = subprocess.Popen(
            [sys.executable, "-m", "prefixrt.cli", "serve", "--model", str(folder), "--device", "cpu", "--tp", "2",
             "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr, "--kv-cache-tokens", "320"],
            cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    # The TP engine starts on a thread (rank 0 mostly waits for rank 1 to import torch) while the oracle runs.
    one = None
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        starting = pool.submit(Engine, str(folder), **kwargs)
        try:
            want_oracle = _hf_greedy(hf, oracle_prompts, 8)
            want_tree = _hf_greedy(hf, tree_prompts, 16)
            one = Engine(str(folder), device="cpu", **POOL)
            tp = starting.result()
        except BaseException:
            if one is not None:
                one.shutdown()
            if starting.exception() is None:
                starting.result().shutdown()
            raise
    try:
        local = tp.core.runner.model.attention_layers[0]
        assert local.num_heads == hf.config.num_attention_heads // 2
        assert local.num_kv_heads == max(1, hf.config.num_key_value_heads // 2)
        rank1 = node1 if node1 is not None else tp._built.ranks.workers.processes[0]
        # One by one: later prompts hit what earlier ones cached.
        seq = [tp.generate(p, {"max_new_tokens": 8, **GREEDY}) for p in oracle_prompts]
        assert [c.token_ids for c in seq] == want_oracle
        assert seq[-1].cached_tokens == len(oracle_prompts[-1]) - 1
        assert [one.generate(p, {"max_new_tokens": 8, **GREEDY}).token_ids for p in oracle_prompts] == want_oracle

        # Batched on a 320-token pool: eviction and retraction on rank 0, the same slots on rank 1.
        got = [c.token_ids for c in tp.generate(tree_prompts, {"max_new_tokens": 16, **GREEDY})]
        assert got == want_tree
        s = tp.stats()
        assert s.evicted_tokens_total > 0, "the pool was meant to be small enough to evict"
        assert s.retracted_requests_total > 0, "the pool was meant to be small enough to retract"
        assert [c.token_ids for c in one.generate(tree_prompts, {"max_new_tokens": 16, **GREEDY})] == want_tree

        # An abort mid-stream: the ranks stay in step (the next request is still exact).
        stream = tp.stream(tree_prompts[0], {"max_new_tokens": 40, **GREEDY})
        first = next(stream)
        tp.abort(first.request_id)
        assert [ch.finish_reason for ch in stream][-1] == "abort"
        assert tp.generate(oracle_prompts[1], {"max_new_tokens": 8, **GREEDY}).token_ids == want_oracle[1]

        # Prefill and decode logits: TP=2 within 1e-5 of TP=1 and of transformers (fp32; measured ~2e-6).
        prompt = tree_prompts[3] + oracle_prompts[2]
        tokens_tp, logits_tp = _logits_of(tp, prompt, 6)
        tokens_one, logits_one = _logits_of(one, prompt, 6)
        assert tokens_tp == tokens_one == _hf_greedy(hf, [prompt], 6)[0]
        with torch.no_grad():
            hf_logits = hf(torch.tensor([prompt + tokens_tp])).logits[0, len(prompt) - 1: len(prompt) + 5].float()
        assert (logits_tp - logits_one).abs().max().item() <= 1e-5
        assert (logits_tp - hf_logits).abs().max().item() <= 1e-5
        assert_idle_and_clean(tp)
        assert_idle_and_clean(one)
    finally:
        tp.shutdown()
        one.shutdown()
        if node1 is not None and node1.poll() is None:
            try:
                node1.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(node1.pid, signal.SIGKILL)
                node1.wait()
    if node1 is not None:
        assert node1.returncode == 0, node1.stdout.read()[-3000:]
    else:
        rank1.join(timeout=10)
        assert rank1.exitcode == 0, "rank 1 did not return cleanly at shutdown"


def test_tp_config_errors():
    from prefixrt.config.engine_config import EngineConfig

    with pytest.raises(ValueError, match="multiple of nnodes"):
        EngineConfig(tp_size=3, nnodes=2, dist_init_addr="h:1")
    with pytest.raises(ValueError, match="dist_init_addr"):
        EngineConfig(tp_size=2, nnodes=2)
    with pytest.raises(ValueError, match="host:port"):
        EngineConfig(tp_size=2, dist_init_addr="nohost")
    with pytest.raises(ValueError, match="host KV tier"):
        EngineConfig(tp_size=2, host_kv_cache_tokens=64)


def test_shard_model_splits_heads_and_refuses_what_does_not_split(tiny_checkpoints):
    """shard_model on the meta model: local head counts (KV heads replicated past their number) and errors."""
    from transformers import AutoConfig

    from prefixrt.hub.loader import _instantiate
    from prefixrt.parallel.layers import TPGroup, first_kv_head

    path, _ = tiny_checkpoints("llama")  # 4 heads, 2 KV heads
    config = AutoConfig.from_pretrained(str(path))
    model = _instantiate(config, dtype="float32", device="meta", tp=TPGroup(rank=1, size=2))
    layer = model.attention_layers[0]
    assert (layer.num_heads, layer.num_kv_heads) == (2, 1)
    assert model.model.layers[0].self_attn.qkv_proj.parts["k_proj"] == (16, 16)  # KV head 1 of head_dim 16
    model4 = _instantiate(config, dtype="float32", device="meta", tp=TPGroup(rank=3, size=4))
    assert (model4.attention_layers[0].num_heads, model4.attention_layers[0].num_kv_heads) == (1, 1)
    assert [first_kv_head(2, 4, r) for r in range(4)] == [0, 0, 1, 1]  # replicated: query heads r read KV r // 2
    with pytest.raises(ValueError, match="cannot be split"):
        _instantiate(config, dtype="float32", device="meta", tp=TPGroup(rank=0, size=3))


def test_vocab_shards_and_batch_messages_round_trip():
    """The last vocabulary shard is zero-padded; prefix groups survive the step message's encoding."""
    from prefixrt.model.cuda_graphs import CascadeSpec
    from prefixrt.parallel.layers import _vocab_rows, vocab_per_rank
    from prefixrt.parallel.tp_runner import (
        CAPTURE_INTS,
        _decode_capture,
        _decode_groups,
        _encode_capture,
        _encode_groups,
    )

    table = torch.arange(10.0).view(5, 2)
    assert vocab_per_rank(5, 2) == 3
    assert _vocab_rows(table, 0, 3).tolist() == table[:3].tolist()
    assert _vocab_rows(table, 3, 3).tolist() == [[6.0, 7.0], [8.0, 9.0], [0.0, 0.0]]
    groups = [(256, [0, 2, 5]), (512, [1, 3])]
    assert _decode_groups(_encode_groups(groups)) == groups
    assert _decode_groups(_encode_groups(None)) is None
    spec = CascadeSpec(queries_per_tile=16, min_prefix_len=256, min_group_size=2, max_groups=6)
    for cascade in (spec, None):
        args = (3, 64, 4096, 1024, True, cascade)
        ints = _encode_capture(*args)
        assert len(ints) == CAPTURE_INTS and all(isinstance(i, int) for i in ints)
        assert _decode_capture(ints) == args
