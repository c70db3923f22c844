"""The host work of admitting requests that share a long cached prefix, without a GPU: the RAG case (64 requests,
one shared 3500-token prefix + 80 unique tokens each, all submitted at once). The leader prefills the prefix while
the 63 followers are held back (dedup_shared_prefill); once the prefix is cached, one scheduler step admits the
followers and one build packs their EXTEND batch (63 x 80 tokens over 3500 cached each); the process() of that step
publishes each follower's prompt to the prefix cache. On a GPU the device idles for that host work. Here the forward is replaced by constant logits on a tiny checkpoint (as in host_loop.py), so
what is timed is exactly that step's schedule() and build(): thread CPU time and wall time, minimum over repeats
(robust to a loaded machine); --profile N: one more run with the loop thread under cProfile, its N costliest
functions (the whole run's, not that step's alone);
--insert reference,below: the followers' prompts published by radix insert + match from the root (the reference,
engine setting radix_insert_below=False) or from each follower's locked node (RadixCache.insert_below, the
engine's default), one engine each way.

    PYTHONPATH=$PWD python benchmarks/host_admission.py [--requests 64] [--prefix 3500] [--suffix 80] [--repeats 7]
        [--profile 25] [--insert reference,below]
"""

from __future__ import annotations

import contextlib
import io
import os
import pstats
import random
import tempfile
import threading
from pathlib import Path

import torch

from benchmarks.common import constant_logits_engine, script_parser
from prefixrt.engine.engine import Engine
from tests.helpers.checkpoints import build_hf_model
from tests.helpers.engines import make_tiny_tokenizer

UNITS = ("schedule", "build", "process")


def build_engine(requests: int, max_context: int, insert_below: bool) -> Engine:
    """A tiny llama (long enough positions for the prompts) whose forward returns constant logits."""
    path = Path(tempfile.mkdtemp())
    build_hf_model("llama", max_position_embeddings=max_context).save_pretrained(str(path))
    make_tiny_tokenizer().save_pretrained(path)
    return constant_logits_engine(path, kv_cache_tokens=requests * max_context, max_running_requests=requests,
                                  radix_insert_below=insert_below)


def rag_prompts(requests: int, prefix: int, suffix: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(3, vocab) for _ in range(prefix)]
    return [shared + [rng.randrange(3, vocab) for _ in range(suffix)] for _ in range(requests)]


def submit_at_once(eng: Engine, prompts: list[list[int]], params: dict) -> list:
    """generate(prompts, params) with every request in the loop's inbox before its next step (as when they arrive
    during a long forward on a GPU; here the forward is instant and they would trickle in)."""
    out: list = []
    with eng.probes.hold_loop() as held:
        caller = threading.Thread(target=lambda: out.append(eng.generate(prompts, params)))
        caller.start()
        held.wait_queued(len(prompts))
    caller.join()
    return out[0]


def measure(eng: Engine, prompts: list[list[int]], output_tokens: int, followers: int, profile: bool = False) -> dict:
    """One RAG run on an empty cache: the schedule() that admits the followers and the build() of that batch
    (profile: under cProfile, whose overhead inflates the times)."""
    eng.flush_cache()
    params = {"max_new_tokens": output_tokens, "temperature": 0, "ignore_eos": True, "detokenize": False}
    with contextlib.ExitStack() as stack:
        units = stack.enter_context(eng.probes.time_units(UNITS, fence_wait=False, record_calls=True))
        prof = stack.enter_context(eng.probes.profile_loop()) if profile else None
        res = submit_at_once(eng, prompts, params)
    calls = [{"unit": r["unit"], "cpu": r["cpu_s"], "wall": r["wall_s"], "admitted": r["extend_rows"]}
             for r in units.records]
    assert all(len(r.token_ids) == output_tokens for r in res)
    hits = [c for c in calls if c["admitted"] == followers]
    units = [c["unit"] for c in hits]
    assert units == list(UNITS), f"expected one step admitting {followers} followers, saw {units}"
    out = {}
    for c in hits:
        out[f"{c['unit']}_cpu_ms"] = c["cpu"] * 1e3
    out["total_cpu_ms"] = sum(c["cpu"] for c in hits) * 1e3
    for c in hits:
        out[f"{c['unit']}_wall_ms"] = c["wall"] * 1e3
    out["total_wall_ms"] = sum(c["wall"] for c in hits) * 1e3
    out["profile"] = prof
    return out


def main() -> None:
    ap = script_parser(__doc__)
    ap.add_argument("--requests", type=int, default=64, help="requests sharing the prefix (a leader, the followers)")
    ap.add_argument("--prefix", type=int, default=3500, help="shared prefix, in tokens")
    ap.add_argument("--suffix", type=int, default=80, help="each request's own tokens")
    ap.add_argument("--output-tokens", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7, help="timed runs; the minimum is reported")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="print the N costliest functions")
    ap.add_argument("--insert", default="below", help="reference,below: how followers' prompts are published")
    args = ap.parse_args()
    torch.set_num_threads(1)
    max_context = 1 << (args.prefix + args.suffix + args.output_tokens + 64).bit_length()
    for way in args.insert.split(","):
        eng = build_engine(args.requests, max_context, insert_below=way == "below")
        prompts = rag_prompts(args.requests, args.prefix, args.suffix, eng.vocab_size)
        try:
            measure(eng, prompts, args.output_tokens, args.requests - 1)  # warm
            runs = [measure(eng, prompts, args.output_tokens, args.requests - 1) for _ in range(args.repeats)]
            if args.profile:
                profiled = measure(eng, prompts, args.output_tokens, args.requests - 1, profile=True)
            eng.check_integrity()
        finally:
            eng.shutdown()
        report(args, way, runs, profiled if args.profile else None)


def report(args, way: str, runs: list[dict], profiled: dict | None) -> None:
    keys = [k for k in runs[0] if k != "profile"]
    best = {k: min(r[k] for r in runs) for k in keys}
    print(f"{args.requests} requests, {args.prefix} shared + {args.suffix} unique tokens: the step admitting "
          f"{args.requests - 1} followers (min of {args.repeats}); prompts published by insert {way}")
    for k in keys:
        print(f"  {k:>17} {best[k]:9.3f}")
    if profiled is not None:
        out = io.StringIO()
        pstats.Stats(profiled["profile"], stream=out).sort_stats("tottime").print_stats(args.profile)
        print("--- profile of the loop thread (one more run, under cProfile; by own time)")
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:6000])


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
