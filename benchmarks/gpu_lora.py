"""Many LoRA adapters on one H100 or H200, Llama-3-8B shape (the Llama-3.1-8B projections) with dummy weights, rank-16
PEFT adapters of q/k/v/o and gate/up/down written to a temporary folder (adapter_config.json +
adapter_model.safetensors, as peft's save_pretrained writes them; a few random weight files hard-linked into every
adapter folder, each folder's own lora_alpha giving it its own weights and digest):
(1) kernels: the Triton LoRA kernels (kernels/lora.py) against the torch reference (kernels/lora_reference.py) on
    the device, at the 8B projections (qkv, o, gate_up, down), a decode batch of 64 rows under 56 adapters and 8 of
    the base model, and a prefill batch mixing adapters and the base model; eager plans, CUDA-graph (padded) plans
    and no K split; the LoRA update's time per decode step at batch 64 (32 layers, one CUDA graph replayed, as the
    engine runs it) under each launch layout
    of LAUNCH_VARIANTS (the engine's, and wider K splits, deeper shrink pipelines, several expand tiles a program),
    the shrink's share apart;
(2) 64 adapters, 64 resident: the RAG shape with one shared prefix per adapter (64 adapters x 4 requests of
    3500 shared + 80 unique tokens, 200 out, ignore_eos), round-robin over the adapters (every adapter's first
    request, then every adapter's second, ...), concurrency 64, streamed with text, from an empty cache: once on the
    base model (the same prompts, no adapter) and once under the adapters, on the same engine. Output tok/s and
    their ratio (target >= 0.85), the hit rate of each adapter against the base model's on the same prefix
    (cached_tokens of each request's usage; target: equal), and the engine's per-adapter counters against them;
(3) 256 adapters, 32 resident (max_loras=32, loaded at run time by load_lora_adapter): 256 x 2 requests of 1024
    shared + 64 unique tokens, 128 out, round-robin, concurrency 64: the run completes; wall time, adapter loads,
    their summed seconds and the load share of wall time (EngineStats.lora_load_busy_seconds_total: seconds with at
    least one load in flight), and the forwards' device time over the same wall (Engine.probes.log_forwards), so a
    load share beside a busy device says the loads overlapped the batch;
(4) plain: section 2's trace on an engine built without LoRA, so the adapters' throughput is also compared with the
    base model on an engine that launches no LoRA kernel at all.
Sections that would start past --budget-s are skipped (said so in the table). Prints a short table last and writes
JSON to $OUT/gpu-lora.json.

    PYTHONPATH=$PWD python benchmarks/gpu_lora.py              # on the GPU host: one call, about 6 minutes
    PYTHONPATH=$PWD python benchmarks/gpu_lora.py --smoke      # the same logic at tiny shapes on the CPU
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import json
import os
import random
import tempfile
import time
from pathlib import Path

from benchmarks.common import log, log_table, rel_err, replay_ms, run_section, script_parser, write_results

RESULTS: dict = {}
SUMMARY: list[tuple[str, str, str]] = []  # (what, value, note)
T_START = time.perf_counter()
MODEL = "llama-3-8b"
RANK = 16
THROUGHPUT_TARGET = 0.85  # adapters / base model, same trace (the acceptance line)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MLP = ("gate_proj", "up_proj", "down_proj")

# The traces: (adapters, requests per adapter, shared tokens, unique tokens, output tokens, concurrency)
SHAPES = {
    "rag64": (64, 4, 3500, 80, 200, 64),
    "many256": (256, 2, 1024, 64, 128, 64),
}
SMOKE_SHAPES = {
    "rag64": (4, 3, 40, 8, 4, 4),
    "many256": (6, 2, 24, 6, 4, 4),
}
RESIDENT = {"rag64": 64, "many256": 32}
SMOKE_RESIDENT = {"rag64": 4, "many256": 2}


def over_budget(what: str, budget_s: float) -> bool:
    if time.perf_counter() - T_START > budget_s:
        SUMMARY.append((what, "SKIPPED", f"past the {budget_s:.0f} s budget"))
        return True
    return False


# ------------------------------------------------------------------------------------------------ adapters


def projection_dims(config: dict) -> dict[str, tuple[int, int]]:
    """PEFT target module -> (in, out) features of a Llama-like config.json."""
    h, i = config["hidden_size"], config["intermediate_size"]
    hd = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def write_weights(path: Path, num_layers: int, dims: dict, rank: int, seed: int) -> None:
    """One adapter_model.safetensors of random bf16 lora_A / lora_B for every layer and target, under peft's tensor
    names. A ~ N(0, 1/in) (PEFT's kaiming-like start), B ~ N(0, 0.02^2): the update stays a small fraction of the
    dummy base projection's output, so activations stay finite through 32 layers."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers):
        for target in TARGETS:
            fan_in, fan_out = dims[target]
            prefix = f"base_model.model.model.layers.{layer}.{'mlp' if target in MLP else 'self_attn'}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=gen) * fan_in ** -0.5
                                                  ).to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen) * 0.02).to(torch.bfloat16)
    save_file(tensors, str(path), metadata={"format": "pt"})


def write_adapters(root: Path, model_path: Path, count: int, weight_files: int, rank: int) -> dict:
    """`count` PEFT adapter folders under root/adapters (a000, a001, ...): `weight_files` random weight files, each
    hard-linked (copied where links fail) into every weight_files-th folder, and per folder its own
    adapter_config.json whose lora_alpha differs, so no two adapters compute the same update or share a digest."""
    config = json.loads((model_path / "config.json").read_text())
    dims, num_layers = projection_dims(config), config["num_hidden_layers"]
    t0 = time.perf_counter()
    weights = root / "weights"
    weights.mkdir(parents=True)
    files = []
    for j in range(weight_files):
        files.append(weights / f"w{j}.safetensors")
        write_weights(files[-1], num_layers, dims, rank, seed=1000 + j)
    t_weights = time.perf_counter() - t0
    folders = []
    per_file = -(-count // weight_files)
    for i in range(count):
        folder = root / "adapters" / f"a{i:03d}"
        folder.mkdir(parents=True)
        alpha = 2 * rank * (1 + 0.5 * (i // weight_files) / per_file)  # scaling in [2, 3): distinct per folder
        (folder / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
            "target_modules": list(TARGETS), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "inference_mode": True,
            "base_model_name_or_path": str(model_path)}, indent=1))
        target = folder / "adapter_model.safetensors"
        try:
            os.link(files[i % weight_files], target)
        except OSError:
            import shutil

            shutil.copyfile(files[i % weight_files], target)
        folders.append(folder)
    size = files[0].stat().st_size
    out = {"count": count, "weight_files": weight_files, "file_mib": round(size / 2**20, 1),
           "weights_s": round(t_weights, 1), "total_s": round(time.perf_counter() - t0, 1),
           "folders": [str(f) for f in folders]}
    log(f"{count} adapters written ({weight_files} weight files of {out['file_mib']} MiB) in {out['total_s']} s")
    return out


# ------------------------------------------------------------------------------------------------ (1) kernels

# Launch layouts of the LoRA kernels timed on the decode batch ("current": the engine's): the shrink's K split aims at
# per_sm programs per SM (at most max_split slices) with shrink_stages pipeline stages; the expand adds
# tiles_per_program column tiles per program.
LAUNCH_VARIANTS = {
    "current": {"per_sm": 2, "max_split": 8, "shrink_stages": 2, "tiles_per_program": 1},
    "expand x8": {"per_sm": 2, "max_split": 8, "shrink_stages": 2, "tiles_per_program": 8},
    "expand x32": {"per_sm": 2, "max_split": 8, "shrink_stages": 2, "tiles_per_program": 32},
    "shrink 4 stages": {"per_sm": 2, "max_split": 8, "shrink_stages": 4, "tiles_per_program": 1},
    "shrink 8/SM": {"per_sm": 8, "max_split": 16, "shrink_stages": 2, "tiles_per_program": 1},
    "shrink 8/SM 4 stages, expand x8": {"per_sm": 8, "max_split": 16, "shrink_stages": 4, "tiles_per_program": 8},
    "shrink 8/SM 4 stages, expand x32": {"per_sm": 8, "max_split": 16, "shrink_stages": 4, "tiles_per_program": 32},
}


def kernel_checks(smoke: bool, dev, dims: dict, num_layers: int) -> dict:
    """kernels/lora.py against kernels/lora_reference.py on the device at the model's projections: relative error
    of the update (got - y0 against want - y0, the reference in float32), the base model's rows left bit for bit;
    and the update's device time per decode step at 64 rows (every projection of every layer)."""
    import torch
    from prefixrt.kernels import lora as K
    from prefixrt.kernels.lora_plan import block_m_for, max_blocks, plan_lists
    from prefixrt.kernels.lora_reference import lora_apply as reference

    gen = torch.Generator().manual_seed(0)
    projections = {"qkv": (dims["q_proj"][0], [dims["q_proj"][1], dims["k_proj"][1], dims["v_proj"][1]]),
                   "o": (dims["o_proj"][0], [dims["o_proj"][1]]),
                   "gate_up": (dims["gate_proj"][0], [dims["gate_proj"][1], dims["up_proj"][1]]),
                   "down": (dims["down_proj"][0], [dims["down_proj"][1]])}
    num_slots, rank = (64, RANK) if not smoke else (4, 8)
    decode_rows = 64 if not smoke else 8
    batches = {  # (slot of each sequence, its rows): -1 = the base model
        "decode": ([-1 if j % 8 == 7 else j % num_slots for j in range(decode_rows)], [1] * decode_rows),
        "prefill": ([0, 3, -1, 3, 1], [300, 17, 1, 120, 1] if not smoke else [20, 5, 1, 7, 1]),
    }
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 0

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16).to(dev)

    def tensors(plan):
        return [torch.tensor(v, dtype=torch.int32, device=dev)
                for v in (plan.sorted_tokens, plan.block_slot, plan.block_start, plan.block_end)]

    worst, base_rows_changed, out = {}, 0, {}
    weights = {}
    for name, (k, shards) in projections.items():
        n = sum(shards)
        a = randn(num_slots, len(shards) * rank, k, scale=k ** -0.5)
        b = randn(num_slots, n, rank, scale=rank ** -0.5)
        scale = (torch.rand(num_slots, len(shards), generator=gen) + 0.5).to(dev)
        weights[name] = (a, b, scale, K.tile_table(shards, dev))
        for batch, (slots, lens) in batches.items():
            t = sum(lens)
            x, y0 = randn(t, k), randn(t, n)
            bm = block_m_for(t, len(lens))
            eager = plan_lists(slots, lens, bm)
            padded = plan_lists(slots, lens, bm, num_blocks=max_blocks(t, min(len(lens), num_slots), bm))
            want = reference(x.float(), y0.float().clone(), a.float(), b.float(), scale, shards, *tensors(eager))
            base = torch.zeros(t, dtype=torch.bool, device=dev)
            starts = [sum(lens[:i]) for i in range(len(lens))]
            for s, r0, m in zip(slots, starts, lens):
                if s < 0:
                    base[r0:r0 + m] = True
            for label, plan in (("eager", eager), ("graph", padded), ("no_split", eager)):
                split = 1 if label == "no_split" else K.shrink_split(plan.num_blocks, k, num_sms, 64)
                got = K.lora_apply(x, y0.clone(), a, b, scale, weights[name][3], *tensors(plan), block_m=bm,
                                   split_k=split)
                err = rel_err(got.float() - y0.float(), want - y0.float())
                key = f"{name}_{batch}_{label}"
                worst[key] = round(err, 5)
                base_rows_changed += int((got[base] != y0[base]).any(dim=-1).sum())
    out["update_rel_err"] = worst
    out["base_rows_changed"] = base_rows_changed
    limit = 2e-2
    # The decode batch's update under each launch layout (LAUNCH_VARIANTS): equal to the reference at every one;
    # on the GPU, its device time per decode step (every projection of every layer), shrink and expand apart.
    slots, lens = batches["decode"]
    bm = block_m_for(len(lens), len(lens))
    plan = plan_lists(slots, lens, bm, num_blocks=max_blocks(len(lens), min(len(lens), num_slots), bm))
    idx = tensors(plan)
    inputs = {name: (randn(len(lens), k), randn(len(lens), sum(shards))) for name, (k, shards) in projections.items()}
    wants = {}  # the reference's result per projection: the same for every layout
    for name, (x, y0) in inputs.items():
        a, b, scale, _ = weights[name]
        wants[name] = reference(x.float(), y0.float().clone(), a.float(), b.float(), scale, projections[name][1], *idx)
    variants = {}
    for label, v in (LAUNCH_VARIANTS if not smoke else dict(list(LAUNCH_VARIANTS.items())[:2])).items():
        calls, worst_v = [], 0.0
        for name, (k, _) in projections.items():
            a, b, scale, tiles = weights[name]
            x, y0 = inputs[name]
            split = K.shrink_split(plan.num_blocks, k, num_sms, 64, v["per_sm"], v["max_split"])
            kw = {"split_k": split, "tiles_per_program": v["tiles_per_program"], "shrink_stages": v["shrink_stages"]}
            got = K.lora_apply(x, y0.clone(), a, b, scale, tiles, *idx, block_m=bm, **kw)
            worst_v = max(worst_v, rel_err(got.float() - y0.float(), wants[name] - y0.float()))
            calls.append((x, y0.clone(), a, b, scale, tiles, kw))
        row = {**v, "rel_err": round(worst_v, 5)}
        if dev.type == "cuda":
            def layer(calls=calls):
                for x, y, a, b, scale, tiles, kw in calls:
                    K.lora_apply(x, y, a, b, scale, tiles, *idx, block_m=bm, **kw)

            def shrinks(calls=calls):
                for x, _, a, *_, kw in calls:
                    K.lora_shrink(x, a, *idx, block_m=bm, split_k=kw["split_k"], stages=kw["shrink_stages"])

            row["ms_per_step"] = round(graph_ms(layer) * num_layers, 3)
            row["shrink_ms_per_step"] = round(graph_ms(shrinks) * num_layers, 3)
        variants[label] = row
    out["decode64_launch_variants"] = variants
    worst_all = max([*worst.values(), *(r["rel_err"] for r in variants.values())])
    ok = worst_all < limit and base_rows_changed == 0
    out["ok"] = ok
    SUMMARY.append(("LoRA kernels vs reference", "ok" if ok else "MISMATCH",
                    f"worst update rel err {worst_all:.1e} ({limit:.0e}), base rows changed {base_rows_changed}, "
                    f"{len(worst)} cases + {len(variants)} launch layouts"))
    if dev.type == "cuda":
        now = variants["current"]
        best_label = min(variants, key=lambda lb: variants[lb]["ms_per_step"])
        best = variants[best_label]
        out["decode64_update_ms_per_step"] = now["ms_per_step"]
        under = len({s for s in slots if s >= 0})
        SUMMARY.append((f"LoRA update, decode b{len(lens)} ({under} adapters)", f"{now['ms_per_step']:.2f} ms/step",
                        f"{num_layers} layers x 4 projections, one CUDA graph replayed; shrink "
                        f"{now['shrink_ms_per_step']:.2f} ms of it"))
        SUMMARY.append(("fastest launch layout", f"{best['ms_per_step']:.2f} ms/step",
                        f"{best_label} (shrink {best['shrink_ms_per_step']:.2f} ms); {len(variants)} layouts timed"))
    log(json.dumps(out, indent=1))
    return out


def graph_ms(fn) -> float:
    """fn's launches captured once in a CUDA graph (as the engine runs them), then replayed: ms per replay."""
    import torch

    fn()  # compiled and warm before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return replay_ms(graph)


# ------------------------------------------------------------------------------------------------ traces


def adapter_trace(vocab: int, adapters: int, per_adapter: int, shared_len: int, unique_len: int,
                  seed: int) -> list[tuple[int, list[int]]]:
    """(adapter index, prompt) in submission order: adapter a's prompts share its own prefix of shared_len tokens,
    then unique_len of their own; round-robin over the adapters (each adapter's first prompt, then each one's
    second, ...), so requests in flight together run under as many adapters as there are."""
    rng = random.Random(seed)

    def ids(n):
        return [rng.randrange(16, vocab) for _ in range(n)]

    prefixes = [ids(shared_len) for _ in range(adapters)]
    return [(a, prefixes[a] + ids(unique_len)) for _ in range(per_adapter) for a in range(adapters)]


def run_trace(eng, trace, names: list[str] | None, max_new: int, concurrency: int) -> dict:
    """Every prompt of the trace streamed with text, `concurrency` at a time, under names[adapter] (None: the base
    model): wall time, output tok/s, TTFT p50, and per adapter index its prompt and cached tokens (usage)."""
    async def run() -> dict:
        sem = asyncio.Semaphore(concurrency)
        ttfts, toks, chars, errors = [], [0], [0], []
        hits: dict[int, list[int]] = {}

        async def one(a, prompt):
            params = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True,
                      "lora": None if names is None else names[a]}
            async with sem:
                t0 = time.perf_counter()
                first, cached, prompt_tokens, n = None, 0, 0, 0
                async for ch in eng.astream(prompt, params):
                    if first is None and ch.token_ids:
                        first = time.perf_counter()
                    n += len(ch.token_ids)
                    chars[0] += len(ch.text)
                    cached, prompt_tokens = max(cached, ch.cached_tokens), max(prompt_tokens, ch.prompt_tokens)
                    if ch.error:
                        errors.append(ch.error)
                toks[0] += n
                if n != max_new:
                    errors.append(f"{n} tokens of {max_new}")
                ttfts.append((first or time.perf_counter()) - t0)
                h = hits.setdefault(a, [0, 0])
                h[0] += cached
                h[1] += prompt_tokens

        t0 = time.perf_counter()
        await asyncio.gather(*(one(a, p) for a, p in trace))
        dt = time.perf_counter() - t0
        ttfts.sort()
        return {"seconds": round(dt, 3), "out_tok_s": round(toks[0] / dt, 1), "output_tokens": toks[0],
                "ttft_p50_ms": round(ttfts[len(ttfts) // 2] * 1000, 1), "text_chars": chars[0],
                "requests": len(trace), "errors": errors[:5], "num_errors": len(errors),
                "hits": {a: hits[a] for a in sorted(hits)}}

    return asyncio.run(run())


def warm_up(eng, vocab: int, names: list[str] | None, count: int, length: int, long: int = 0) -> None:
    """`count` requests of `length` tokens, one per adapter of names (each adapter's load, the kernels' first
    launches) or on the base model; then 8 of `long` tokens (the trace's prompt length: the prefill chunks' kernel
    variants compiled before any timed run), all 4 tokens out."""
    rng = random.Random(99)
    trace = [(a, [rng.randrange(16, vocab) for _ in range(length)]) for a in range(count)]
    run_trace(eng, trace, names, 4, len(trace))
    if long:
        trace = [(a, [rng.randrange(16, vocab) for _ in range(long)]) for a in range(min(8, count))]
        run_trace(eng, trace, names, 4, len(trace))


def lora_counters(eng) -> dict:
    s = eng.stats()
    return {"loads": s.lora_loads_total, "load_s": s.lora_load_seconds_total,
            "busy_s": s.lora_load_busy_seconds_total, "resident": s.lora_resident_adapters,
            "adapters": {name: dict(c) for name, c in s.lora_adapters.items()}}


def hit_rate(h: list[int]) -> float:
    return h[0] / h[1] if h[1] else 0.0


def build_engine(model: str, smoke: bool, kw: dict, label: str):
    import prefixrt

    t = time.perf_counter()
    eng = prefixrt.Engine(model, load_format="dummy" if not smoke else "auto", **kw)
    startup = round(time.perf_counter() - t, 1)
    facts = eng.probes.facts()
    log(f"[{label}] engine up in {startup} s, KV pool {eng.kv_total_tokens} tokens, cuda graphs "
        f"{facts.get('cuda_graphs')}")
    return eng, {"startup_s": startup, "kv_pool_tokens": eng.kv_total_tokens, "cuda_graphs": facts.get("cuda_graphs")}


def free(eng) -> None:
    import torch

    eng.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------ (2) 64 adapters


def rag_adapters(smoke: bool, model: str, kw: dict, folders: list[str], shape: tuple, resident: int,
                 repeats: int) -> dict:
    adapters, per_adapter, shared, unique, out_len, conc = shape
    names = [f"rag-{i:03d}" for i in range(adapters)]
    eng, out = build_engine(model, smoke, {**kw, "lora_adapters": dict(zip(names, folders[:adapters])),
                                           "max_loras": resident, "max_lora_rank": RANK}, f"{adapters} adapters")
    try:
        vocab = eng.vocab_size
        trace = adapter_trace(vocab, adapters, per_adapter, shared, unique, seed=5)
        out["trace"] = {"adapters": adapters, "requests": len(trace), "shared": shared, "unique": unique,
                        "output": out_len, "concurrency": conc}
        # the adapters move the greedy tokens (the update is applied), each its own way
        probe = trace[0][1][:64]
        greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
        toks = {n: eng.generate(probe, {**greedy, "lora": n}).token_ids for n in (None, names[0], names[1])}
        out["greedy_differs_from_base"] = toks[names[0]] != toks[None] and toks[names[1]] != toks[None]
        warm_len = 512 if not smoke else 16
        warm_up(eng, vocab, None, adapters, warm_len, shared + unique)
        warm_up(eng, vocab, names, adapters, warm_len, shared + unique)
        runs = {"base": [], "adapters": []}
        for _ in range(repeats):
            for label in ("base", "adapters"):
                eng.flush_cache()
                before = lora_counters(eng)
                r = run_trace(eng, trace, None if label == "base" else names, out_len, conc)
                after = lora_counters(eng)
                r["loads"] = after["loads"] - before["loads"]
                if label == "adapters":  # the engine's own per-adapter counters over the run
                    r["engine_hits"] = {
                        i: [after["adapters"][n]["cached_tokens_total"] - before["adapters"][n]["cached_tokens_total"],
                            after["adapters"][n]["prompt_tokens_total"] - before["adapters"][n]["prompt_tokens_total"]]
                        for i, n in enumerate(names)}
                runs[label].append(r)
                log(f"[{adapters} adapters] {label}: {r['out_tok_s']} out tok/s, {r['seconds']} s, loads {r['loads']}, "
                    f"errors {r['num_errors']}")
        out["runs"] = runs
        base, lora = runs["base"][-1], runs["adapters"][-1]  # the last of each (warmest) is the figure
        out["base_out_tok_s"], out["adapters_out_tok_s"] = base["out_tok_s"], lora["out_tok_s"]
        out["ratio"] = round(lora["out_tok_s"] / base["out_tok_s"], 3)
        rates = [(hit_rate(lora["hits"][a]), hit_rate(base["hits"][a])) for a in range(adapters)]
        out["hit_rate_adapters"] = [round(x, 4) for x, _ in rates]
        out["hit_rate_base"] = [round(y, 4) for _, y in rates]
        out["hits_equal"] = sum(lora["hits"][a] == base["hits"][a] for a in range(adapters))
        out["hit_rate_max_abs_diff"] = round(max(abs(x - y) for x, y in rates), 5)
        out["engine_counters_agree"] = all(lora["engine_hits"][a] == lora["hits"][a] for a in range(adapters))
        out["errors"] = sum(r["num_errors"] for rs in runs.values() for r in rs)
    finally:
        free(eng)
    ok_ratio = out["ratio"] >= THROUGHPUT_TARGET
    SUMMARY.append((f"{adapters} adapters: out tok/s adapters | base", f"{out['adapters_out_tok_s']} | "
                    f"{out['base_out_tok_s']} ({out['ratio']:.2f}x)",
                    f"target >= {THROUGHPUT_TARGET}x: {'met' if ok_ratio else 'NOT met'}; same engine"))
    SUMMARY.append(("hit rate per adapter = base's on its prefix", f"{out['hits_equal']} of {adapters} equal",
                    f"adapters mean {sum(out['hit_rate_adapters']) / adapters:.4f}, base mean "
                    f"{sum(out['hit_rate_base']) / adapters:.4f}, max diff {out['hit_rate_max_abs_diff']}"))
    SUMMARY.append(("engine per-adapter counters = usage", "yes" if out["engine_counters_agree"] else "NO",
                    f"greedy tokens moved by the adapters: {'yes' if out['greedy_differs_from_base'] else 'NO'}; "
                    f"request errors {out['errors']}"))
    SUMMARY.append((f"{adapters}-adapter engine start-up", f"{out['startup_s']} s",
                    f"{adapters} adapters read at start, KV pool {out['kv_pool_tokens']} tokens"))
    return out


# ------------------------------------------------------------------------------------ (3) 256 adapters


def many_adapters(smoke: bool, model: str, kw: dict, folders: list[str], shape: tuple, resident: int) -> dict:
    adapters, per_adapter, shared, unique, out_len, conc = shape
    names = [f"many-{i:03d}" for i in range(adapters)]
    eng, out = build_engine(model, smoke, {**kw, "enable_lora": True, "max_loras": resident,
                                           "max_lora_rank": RANK}, f"{adapters} adapters")
    try:
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:  # host work: read, hash, pack, pin
            list(pool.map(eng.load_lora_adapter, names, folders[:adapters]))
        out["register_s"] = round(time.perf_counter() - t0, 1)
        log(f"[{adapters} adapters] registered in {out['register_s']} s")
        vocab = eng.vocab_size
        warm_up(eng, vocab, names[:resident], resident, 512 if not smoke else 16, shared + unique)
        eng.flush_cache()
        trace = adapter_trace(vocab, adapters, per_adapter, shared, unique, seed=7)
        out["trace"] = {"adapters": adapters, "resident": resident, "requests": len(trace), "shared": shared,
                        "unique": unique, "output": out_len, "concurrency": conc}
        before = lora_counters(eng)
        with eng.probes.log_forwards() as forwards:
            r = run_trace(eng, trace, names, out_len, conc)
        after = lora_counters(eng)
        wall = r["seconds"]
        out["run"] = {k: v for k, v in r.items() if k != "hits"}
        out["completed"] = r["num_errors"] == 0 and r["output_tokens"] == len(trace) * out_len
        out["loads"] = after["loads"] - before["loads"]
        out["load_seconds_sum"] = round(after["load_s"] - before["load_s"], 3)
        out["load_busy_seconds"] = round(after["busy_s"] - before["busy_s"], 3)
        out["load_share_of_wall"] = round(out["load_busy_seconds"] / wall, 4)
        out["load_sum_over_wall"] = round(out["load_seconds_sum"] / wall, 4)
        out["mean_load_ms"] = round(out["load_seconds_sum"] / max(1, out["loads"]) * 1000, 2)
        busy_ms = [row["device_ms"] for row in forwards.rows if row.get("device_ms") is not None]
        out["forwards"] = len(forwards.rows)
        out["device_busy_share"] = round(sum(busy_ms) / 1000 / wall, 4) if busy_ms else None
        out["resident_after"] = after["resident"]
        hits = r["hits"]
        out["hit_rate"] = round(sum(h[0] for h in hits.values()) / max(1, sum(h[1] for h in hits.values())), 4)
        log(f"[{adapters} adapters] {r['out_tok_s']} out tok/s in {wall} s, {out['loads']} loads, load share "
            f"{out['load_share_of_wall']:.1%}, device busy {out['device_busy_share']}")
    finally:
        free(eng)
    SUMMARY.append((f"{adapters} adapters, {resident} resident: completes", "yes" if out["completed"] else "NO",
                    f"{len(trace)} requests in {wall:.1f} s, {r['out_tok_s']} out tok/s, hit rate {out['hit_rate']}"))
    busy = "n/a" if out["device_busy_share"] is None else f"{out['device_busy_share']:.1%}"
    SUMMARY.append(("adapter loads: share of wall (in flight)", f"{out['load_share_of_wall']:.1%}",
                    f"{out['loads']} loads, {out['load_seconds_sum']:.2f} s summed ({out['mean_load_ms']} ms each); "
                    f"forwards' device time {busy} of wall"))
    SUMMARY.append((f"{adapters} adapters registered at run time", f"{out['register_s']} s",
                    f"start-up {out['startup_s']} s, KV pool {out['kv_pool_tokens']} tokens"))
    return out


# ------------------------------------------------------------------------------------ (4) plain engine


def plain_base(smoke: bool, model: str, kw: dict, shape: tuple, repeats: int) -> dict:
    adapters, per_adapter, shared, unique, out_len, conc = shape
    eng, out = build_engine(model, smoke, kw, "no LoRA")
    try:
        vocab = eng.vocab_size
        trace = adapter_trace(vocab, adapters, per_adapter, shared, unique, seed=5)
        warm_up(eng, vocab, None, adapters, 512 if not smoke else 16, shared + unique)
        runs = []
        for _ in range(repeats):
            eng.flush_cache()
            runs.append(run_trace(eng, trace, None, out_len, conc))
            log(f"[no LoRA] base: {runs[-1]['out_tok_s']} out tok/s")
        out["runs"] = runs
        out["out_tok_s"] = runs[-1]["out_tok_s"]
        out["hits"] = runs[-1]["hits"]
    finally:
        free(eng)
    return out


def main() -> None:
    ap = script_parser(__doc__, smoke="the same logic on the CPU: tiny checkpoint and shapes, Triton interpreted")
    ap.add_argument("--only", default="1234", help="sections to run, e.g. 23 (default: all)")
    ap.add_argument("--repeats", type=int, default=1, help="base / adapters runs of section 2 (and 4), alternated")
    ap.add_argument("--budget-s", type=float, default=420, help="start no section past this many seconds")
    ap.add_argument("--weight-files", type=int, default=8, help="distinct random weight files behind the adapters")
    args = ap.parse_args()
    smoke = args.smoke
    if smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported
    import torch

    from prefixrt.hub.registry import resolve_model

    cuda = torch.cuda.is_available() and not smoke
    dev = torch.device("cuda" if cuda else "cpu")
    tmp = tempfile.TemporaryDirectory(prefix="gpu-lora-")
    root = Path(tmp.name)
    if smoke:
        from benchmarks.common import tiny_model_dir

        model = str(tiny_model_dir(root))
        model_path = Path(model)
    else:
        model, model_path = MODEL, Path(resolve_model(MODEL).path)
    shapes = SMOKE_SHAPES if smoke else SHAPES
    resident = SMOKE_RESIDENT if smoke else RESIDENT
    kw = {} if cuda else {"device": "cpu", "attention_backend": "torch", "kv_cache_tokens": 4000}
    RESULTS["device"] = torch.cuda.get_device_name(dev) if cuda else "cpu (smoke)"
    RESULTS["model"] = MODEL if not smoke else "tiny llama"
    config = json.loads((model_path / "config.json").read_text())
    dims = projection_dims(config)
    count = max(shapes[s][0] for s in shapes)
    RESULTS["adapters_written"] = written = write_adapters(root, model_path, count,
                                                           min(args.weight_files, count) if not smoke else 2, RANK)
    folders = written.pop("folders")
    SUMMARY.append(("adapters written", f"{count} in {written['total_s']} s",
                    f"{written['weight_files']} weight files of {written['file_mib']} MiB, hard-linked"))
    try:
        if "1" in args.only and not over_budget("kernels", args.budget_s):
            run_section(RESULTS, SUMMARY, "kernels",
                        lambda: kernel_checks(smoke, dev, dims, config["num_hidden_layers"]))
        if "2" in args.only and not over_budget("64 adapters", args.budget_s):
            run_section(RESULTS, SUMMARY, "adapters64", lambda: rag_adapters(
                smoke, model, kw, folders, shapes["rag64"], resident["rag64"], args.repeats))
        if "3" in args.only and not over_budget("256 adapters", args.budget_s):
            run_section(RESULTS, SUMMARY, "adapters256", lambda: many_adapters(
                smoke, model, kw, folders, shapes["many256"], resident["many256"]))
        if "4" in args.only and not over_budget("plain engine", args.budget_s):
            run_section(RESULTS, SUMMARY, "plain", lambda: plain_base(smoke, model, kw, shapes["rag64"],
                                                                      args.repeats))
            plain, lora = RESULTS.get("plain", {}), RESULTS.get("adapters64", {})
            if plain.get("out_tok_s") and lora.get("adapters_out_tok_s"):
                ratio = lora["adapters_out_tok_s"] / plain["out_tok_s"]
                RESULTS["ratio_vs_plain_engine"] = round(ratio, 3)
                same_hits = plain["hits"] == lora["runs"]["base"][-1]["hits"]
                SUMMARY.append(("adapters / base on an engine without LoRA", f"{ratio:.2f}x",
                                f"plain {plain['out_tok_s']} out tok/s; its hits = the LoRA engine's base run: "
                                f"{'yes' if same_hits else 'NO'}"))
    finally:
        tmp.cleanup()
    write_results(RESULTS, "gpu-lora.json", None)
    log(f"\nprefixrt LoRA, {RESULTS['model']} dummy on {RESULTS['device']}, rank {RANK}, "
        f"total {time.perf_counter() - T_START:.0f}s")
    log_table(SUMMARY, 30)


if __name__ == "__main__":
    main()
