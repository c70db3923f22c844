"""`prefixrt bench` end to end on a tiny checkpoint (CPU): both engine baselines run in one invocation and
the reported cache hit rates are what the workload implies."""

from __future__ import annotations

import json

from prefixrt.bench import workloads as W


def test_optimal_hit_rate_counts_each_distinct_prefix_once():
    assert W.optimal_hit_rate([[1, 2, 3], [1, 2, 4], [1, 2, 3]]) == (9 - 4) / 9  # trie nodes: 1, 2, 3, 4
    assert W.optimal_hit_rate([[1], [2]]) == 0.0


def test_workload_shapes():
    w = W.shared_prefix(1000, groups=3, prompts_per_group=4, system_len=20, question_len=5, output_len=7)
    prompts = [s[0].new_tokens for s in w.sessions]
    assert w.num_requests == 12 and all(len(p) == 25 for p in prompts)
    assert len({tuple(p[:20]) for p in prompts}) == 3
    mt = W.multi_turn(1000, sessions=2, turns=3, min_append=4, max_append=6, output_len=2)
    assert mt.num_requests == 6 and all(len(s) == 3 for s in mt.sessions)


def test_bench_cli_runs_baselines(tiny_checkpoints, tiny_tokenizer, tmp_path, capsys):
    from prefixrt.bench.cli import main

    path, _ = tiny_checkpoints("llama")
    tiny_tokenizer.save_pretrained(str(path))
    out = tmp_path / "r.json"
    rc = main(["--workload", "shared-prefix", "--model", str(path), "--device", "cpu", "--groups", "2",
               "--prompts-per-group", "4", "--system-len", "40", "--question-len", "8", "--output-len", "4",
               "--kv-cache-tokens", "2048", "--json", str(out), "--no-progress"])
    assert rc == 0
    res = json.loads(out.read_text())["results"]
    by = {r["label"]: r for r in res}
    radix, off = by["prefixrt (radix cache)"], by["prefixrt (radix_cache=False)"]
    assert radix["output_tokens"] == off["output_tokens"] == 8 * 4
    assert off["cache_hit_rate"] == 0.0
    # Two groups of four share 40 tokens: the ideal cache reuses 6 x 40 of 8 x 48 prompt tokens.
    assert abs(radix["optimal_hit_rate"] - 240 / 384) < 1e-9
    assert radix["cache_hit_rate"] > 0.5
    assert "req/s" in capsys.readouterr().out
