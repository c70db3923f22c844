"""`prefixrt bench` end to end on a tiny checkpoint (CPU): both engine baselines run in one invocation and
the reported cache hit rates are what the workload implies."""

from __future__ import annotations

import json

import pytest

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


def test_long_context_workload_grows_past_its_appends():
    w = W.long_context(1000, sessions=2, turns=3, append_len=10, output_len=2)
    assert w.num_requests == 6 and all(len(t.new_tokens) == 10 for s in w.sessions for t in s)
    assert "last prompt 34 tokens" in w.description  # 3 x 10 appended + 2 x 2 outputs


def test_prefill_flops_counts_linears_and_causal_keys():
    from prefixrt.bench.compute_floor import ModelShape, floor_report, prefill_flops

    shape = ModelShape(linear_params=100, attention=((2, 4, None), (2, 4, 3)))
    # Positions 2..4 computed (2 cached of 5): full layer keys 3 + 4 + 5, window-3 layer 3 + 3 + 3.
    assert prefill_flops(shape, 5, 2) == 2 * 100 * 3 + 4 * 2 * 4 * (12 + 9)
    assert prefill_flops(shape, 2, 0) == 2 * 100 * 2 + 4 * 2 * 4 * (3 + 3)  # window not reached: 1 + 2
    rep = floor_report(shape, [(5, 2), (2, 0)], duration_s=2.0, peak_tflops=1e-9)  # 1000 FLOP/s
    flops = prefill_flops(shape, 5, 2) + prefill_flops(shape, 2, 0)
    assert rep["computed_prompt_tokens"] == 5 and rep["computed_tok_s"] == 2.5
    assert abs(rep["floor_tok_s"] - 5 / (flops / 1000)) < 0.1


def test_bench_cli_long_context_reports_floor(tiny_checkpoints, tiny_tokenizer, tmp_path, capsys):
    from prefixrt.bench.cli import main
    from prefixrt.bench.compute_floor import ModelShape, prefill_flops
    from prefixrt.hub.loader import load_model

    path, _ = tiny_checkpoints("llama")
    tiny_tokenizer.save_pretrained(str(path))
    out = tmp_path / "r.json"
    rc = main(["--workload", "long-context", "--model", str(path), "--device", "cpu", "--sessions", "2",
               "--turns", "3", "--append-len", "20", "--output-len", "3", "--baselines", "radix",
               "--kv-cache-tokens", "2048", "--json", str(out), "--no-progress"])
    assert rc == 0
    (res,) = json.loads(out.read_text())["results"]
    floor = res["compute_floor"]
    # A later turn reuses the previous prompt and the K/V of all but the last output token (that one was
    # sampled, never fed back): per session 20 + 2, then 43 + 2.
    assert res["cached_tokens"] == 2 * ((20 + 2) + (20 + 3 + 20 + 2))
    assert floor["computed_prompt_tokens"] == res["input_tokens"] - res["cached_tokens"]
    shape = ModelShape.of(load_model(str(path), device="cpu"))
    assert shape.linear_params == 2 * (64 * (64 + 2 * 32 + 64) + 3 * 64 * 128)  # tiny llama: 2 layers
    assert floor["prefill_tflop"] >= 0 and prefill_flops(shape, 20, 0) > 0
    assert "of the floor" in capsys.readouterr().out


def test_split_cold_hot():
    from prefixrt.bench.plot import split_cold_hot
    from prefixrt.bench.runner import RequestRecord

    recs = [RequestRecord(10, 0, 2, 0.3, 0.5), RequestRecord(10, 8, 2, 0.1, 0.2), RequestRecord(10, 0, 2, 0.2, 0.4)]
    assert split_cold_hot(recs) == ([0.2, 0.3], [0.1])


def test_bench_cli_plot_writes_a_png(tiny_checkpoints, tiny_tokenizer, tmp_path, capsys):
    """--plot draws a real PNG beside the table and the JSON (both baselines: cold and hot requests)."""
    pytest.importorskip("matplotlib", reason="matplotlib is in the bench extra: pip install -e '.[bench]'")
    import matplotlib.image

    from prefixrt.bench.cli import main

    path, _ = tiny_checkpoints("llama")
    tiny_tokenizer.save_pretrained(str(path))
    png, out = tmp_path / "bench.png", tmp_path / "r.json"
    rc = main(["--workload", "shared-prefix", "--model", str(path), "--device", "cpu", "--groups", "2",
               "--prompts-per-group", "4", "--system-len", "40", "--question-len", "8", "--output-len", "4",
               "--kv-cache-tokens", "2048", "--json", str(out), "--plot", str(png), "--no-progress"])
    assert rc == 0 and json.loads(out.read_text())["results"]
    assert f"plot written to {png}" in capsys.readouterr().out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    img = matplotlib.image.imread(str(png))
    assert img.shape[0] >= 400 and img.shape[1] >= 1000  # 13 x 5.2 in at 110 dpi
    assert img[..., :3].std() > 0.05  # drawn, not blank


def test_bench_cli_text_streams_detokenized_text(tiny_checkpoints, tiny_tokenizer, tmp_path):
    """--text: the same greedy tokens, now streamed as text (what an OpenAI client receives), characters
    counted."""
    from prefixrt.bench.cli import main

    path, _ = tiny_checkpoints("llama")
    tiny_tokenizer.save_pretrained(str(path))
    results = {}
    for flag in ([], ["--text"]):
        out = tmp_path / f"r{len(flag)}.json"
        rc = main(["--workload", "shared-prefix", "--model", str(path), "--device", "cpu", "--groups", "1",
                   "--prompts-per-group", "3", "--system-len", "16", "--question-len", "4", "--output-len", "5",
                   "--kv-cache-tokens", "1024", "--baselines", "radix", "--json", str(out), "--no-progress", *flag])
        assert rc == 0
        results[bool(flag)] = json.loads(out.read_text())["results"][0]
    ids, text = results[False], results[True]
    assert ids["streamed"] == "token ids" and text["streamed"] == "text"
    assert ids["output_tokens"] == text["output_tokens"] == 15
    assert text["text_chars"] > 0 and "text_chars" not in ids
