"""`prefixrt bench`: run a token-level workload against the in-process engine (and its baselines in the
same run) or against a `prefixrt serve` URL; prints a table and optionally writes JSON.

    prefixrt bench --workload shared-prefix --model gemma-3-270m --groups 2 --prompts-per-group 16 \\
        --system-len 512 --question-len 32 --output-len 32 --baselines radix,no-radix,hf
    prefixrt bench --workload rag --model llama-3-8b --load-format dummy
    prefixrt bench --workload random --url http://127.0.0.1:30000
    prefixrt bench --workload shared-prefix --plot bench.png   # throughput + cold/hot TTFT as a picture
    prefixrt bench --workload long-context --model llama-3-8b --load-format dummy --baselines radix

    prefixrt bench --program tree-of-thought --model llama-3-8b --load-format dummy --preset gpu \
        --ablations full,no-cache,block-cache,fcfs,no-hint,no-parallel --json tot.json --plot tot.png
    prefixrt bench --program all --preset ci --url http://127.0.0.1:30000 --ablations full,no-hint

--program runs the SGLang paper's LM-program workloads (prefixrt/bench/programs/, docs/benchmarks-programs.md):
programs/s, tokens/s, program latency, cache hit rate and the ideal hit rate of the same request trace, under each
ablation (engine ablations need an in-process engine; over --url only full, no-hint and no-parallel run).

long-context also prints the throughput of the computed (uncached) prompt tokens beside the bf16 compute
floor (compute_floor.py; --peak-tflops, default the H200's 790).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import sys

from prefixrt.bench import runner as R
from prefixrt.bench import workloads as W
from prefixrt.bench.compute_floor import H200_BF16_DENSE_TFLOPS, ModelShape, floor_report, format_floor
from prefixrt.config.flags import add_engine_args, engine_kwargs
from prefixrt.default_models import BASE_MODEL

# The engine's flags a benchmark run takes (config/engine_config.py declares them; --radix-cache is a baseline here).
ENGINE_FLAGS = ("load_format", "device", "dtype", "seed", "attention_backend", "kv_cache_tokens", "page_size",
                "schedule_policy", "prefix_cache", "chunked_prefill_tokens", "max_running_requests",
                "host_kv_cache_tokens", "host_kv_write_policy", "host_kv_prefetch")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="prefixrt bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--program", default=None,
                    help="an LM-program workload (or 'all', or a comma list) instead of --workload: "
                         "mmlu, hellaswag, react, generative-agents, tree-of-thought, skeleton-of-thought, "
                         "llm-judge, json, multi-turn-short, multi-turn-long, dspy-rag")
    ap.add_argument("--preset", default="ci", choices=["ci", "gpu"], help="--program sizes (base.py)")
    ap.add_argument("--ablations", default="full,no-cache",
                    help="--program: comma list of full, no-cache, block-cache, fcfs, no-hint, no-parallel")
    ap.add_argument("--num-threads", type=int, default=64, help="--program: programs run at once")
    ap.add_argument("--tokenizer", default=None,
                    help="--program with --url: registry name or folder of the served model's tokenizer "
                         "(default: the served model's name)")
    ap.add_argument("--workload", choices=["shared-prefix", "rag", "random", "multi-turn", "long-context", "agent"],
                    default="shared-prefix")
    add_engine_args(ap, default_model=BASE_MODEL, only=ENGINE_FLAGS)  # --model and the engine's flags
    ap.add_argument("--model-config", dest="model", help="alias of --model (e.g. llama-3-8b with dummy weights)")
    ap.add_argument("--url", default=None, help="benchmark a running `prefixrt serve` instead")
    ap.add_argument("--baselines", default="radix,no-radix",
                    help="comma list of: radix, no-radix, hf (transformers generate)")
    ap.add_argument("--concurrency", type=int, default=1024, help="requests in flight at most")
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--plot", default=None, metavar="OUT.png",
                    help="also draw throughput and cold/hot TTFT distributions here (needs matplotlib)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--text", action="store_true",
                    help="stream text (detokenize on, as OpenAI clients receive it) instead of token ids")
    # workload shapes
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--prompts-per-group", type=int, default=16)
    ap.add_argument("--system-len", type=int, default=2048)
    ap.add_argument("--question-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--sessions", type=int, default=None, help="multi-turn: 32; long-context: 4; agent: 16")
    ap.add_argument("--turns", type=int, default=None, help="multi-turn: 4; long-context: 8; agent: 6")
    ap.add_argument("--append-len", type=int, default=None,
                    help="tokens appended a turn (long-context: 4000; agent: 2048)")
    ap.add_argument("--shared-len", type=int, default=16384, help="agent: the context every session shares")
    ap.add_argument("--own-len", type=int, default=8192, help="agent: each session's own first context")
    ap.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS,
                    help="dense bf16 peak for the compute floor (long-context)")
    return ap


def make_workload(args, vocab: int) -> W.Workload:
    if args.workload == "shared-prefix":
        return W.shared_prefix(vocab, args.groups, args.prompts_per_group, args.system_len, args.question_len,
                               args.output_len or 256, args.seed)
    if args.workload == "rag":
        return W.rag(vocab, args.requests or 64, 3500, 80, args.output_len or 200, args.seed)
    if args.workload == "random":
        return W.random_prompts(vocab, args.requests or 256, args.input_len, args.output_len or 256, args.seed)
    if args.workload == "long-context":
        return W.long_context(vocab, args.sessions or 4, args.turns or 8, args.append_len or 4000,
                              args.output_len or 32, args.seed)
    if args.workload == "agent":
        return W.agent(vocab, args.sessions or 16, args.turns or 6, args.shared_len, args.own_len,
                       args.append_len or 2048, args.output_len or 64, args.seed)
    return W.multi_turn(vocab, args.sessions or 32, args.turns or 4, output_len=args.output_len or 64, seed=args.seed)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.program:
        from prefixrt.bench.programs.cli import run_programs

        return run_programs(args, argv)
    results: list[R.Result] = []
    floors: list[str] = []  # long-context: computed-token throughput beside the compute floor, per run
    meta = {"date": datetime.date.today().isoformat(), "argv": ["prefixrt", "bench", *(argv or sys.argv[1:])],
            "host": platform.node(), "python": platform.python_version()}
    show = not args.no_progress
    if args.url:
        from prefixrt.remote import RemoteEngine

        remote = RemoteEngine(args.url)
        w = make_workload(args, remote.vocab_size)
        meta.update(model=remote.model_name, workload=w.description)
        warm = W.random_prompts(remote.vocab_size, 4, 32, 4, seed=12345)  # as the in-process runs do
        R.run_workload(remote, warm, "warm-up", show_progress=False)
        remote.flush_cache()
        results.append(R.run_workload(remote, w, f"server {args.url}", args.concurrency, show, text=args.text))
    else:
        import torch

        from prefixrt.engine.engine import Engine

        kwargs = engine_kwargs(args)
        baselines = [b.strip() for b in args.baselines.split(",") if b.strip()]
        w = None
        path = dtype = device = None
        for b in baselines:
            if b not in ("radix", "no-radix", "hf"):
                raise SystemExit(f"unknown baseline {b!r}")
            if b == "hf":
                continue
            eng = Engine(args.model, radix_cache=(b == "radix"), **kwargs)
            if w is None:
                w = make_workload(args, eng.vocab_size)
            meta.update(device=str(eng.device), model=eng.model_name, dtype=str(eng._built.dtype),
                        workload=w.description)
            path, dtype, device = eng._built.resolved.path, eng._built.dtype, eng.device
            warm = W.random_prompts(eng.vocab_size, 4, 32, 4, seed=12345)
            R.run_workload(eng, warm, "warm-up", show_progress=False)
            eng.flush_cache()
            label = "prefixrt (radix cache)" if b == "radix" else "prefixrt (radix_cache=False)"
            r = R.run_workload(eng, w, label, args.concurrency, show, text=args.text)
            if args.workload == "long-context":
                shape = ModelShape.of(eng._built.model)
                r.extra["compute_floor"] = floor_report(
                    shape, [(q.prompt_tokens, q.cached_tokens) for q in r.records], r.duration_s, args.peak_tflops)
                floors.append(format_floor(label, r.extra["compute_floor"]))
            results.append(r)
            eng.shutdown()
            eng = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if "hf" in baselines:
            if path is None:
                from prefixrt.engine.builder import resolve_device, resolve_dtype
                from prefixrt.hub.registry import resolve_model

                path = resolve_model(args.model).path
                device = resolve_device(args.device)
                dtype = resolve_dtype(args.dtype, device)
                from transformers import AutoConfig

                w = make_workload(args, AutoConfig.from_pretrained(str(path), local_files_only=True).vocab_size)
            results.append(R.run_hf_generate(str(path), w, load_format=args.load_format, dtype=dtype, device=device,
                                             batch_size=args.hf_batch_size, show_progress=show))
    print(f"# {meta.get('workload', '')} | model {meta.get('model', args.model)} | device {meta.get('device', '')} "
          f"| {meta['date']}")
    print(R.format_table(results))
    for line in floors:
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": [r.to_dict() for r in results]}, f, indent=1)
    if args.plot:
        from prefixrt.bench.plot import plot_results

        plot_results(results, args.plot, title=f"{meta.get('workload', '')} | model {meta.get('model', args.model)}"
                     f" | device {meta.get('device', '')} | {meta['date']}")
        print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
