"""Where a hot-prefix request's time goes through `prefixrt serve`: the client's send, the server process's
stages, the pipe, the engine process's loop units and the way back, as milliseconds after the client began.

    PYTHONPATH=$PWD python benchmarks/serve_timeline.py [--requests 60] [--constant-logits] [--model DIR ...]

One request at a time (gpu_server.py's hot-prefix case: `--shared` cached tokens, then `--new` fresh ones, one
token out, streamed over /v1/completions with httpx, read to the end), after 3 warm ones. Without --model, the
test suite's tiny Llama on the CPU (benchmarks/common.py tiny_model_dir, its context raised to fit). Every
stage is stamped with time.monotonic (one clock for the three processes) by a sitecustomize that wraps the
named functions in the server and engine processes (benchmark-only instrumentation; the code under test is
not changed), installed by SIGUSR1 after start-up. Each stage's first stamp inside a request's window is
taken; the table gives its p50 and minimum over the requests, in time order.

--constant-logits: the engine process's forward returns fixed logits, so what is left is host work (the
serving path's own cost, without the model's). Extra arguments after `--` go to `prefixrt serve`. For a before /
after, copy this script and gpu_server.py into an older checkout and run it there too.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import script_parser, tiny_model_dir

# sitecustomize installed in the server and engine processes: SIGUSR1 wraps the stages, SIGUSR2 saves the stamps
# as <dir>/<pid>.json ([label, monotonic time]).
BOOT = r'''
import json, os, signal, sys, time
_dir = os.environ.get("SERVE_TIMELINE_DIR")
if _dir:
    _stamps = []

    def _wrap(owner, name, before, after=None):
        f = getattr(owner, name)

        def wrapped(*a, **k):
            _stamps.append((before, time.monotonic()))
            try:
                return f(*a, **k)
            finally:
                if after:
                    _stamps.append((after, time.monotonic()))
        setattr(owner, name, wrapped)

    def _engine_side():
        from prefixrt.engine.loop import core
        from prefixrt.engine.process import child
        _wrap(child.EngineProcessServer, "handle", "engine: message received")
        _wrap(core.EngineCore, "schedule", "engine: schedule", "engine: scheduled")
        _wrap(core.EngineCore, "build", "engine: build", "engine: built")
        _wrap(core.EngineCore, "launch", "engine: launch", "engine: launched")
        _wrap(core.EngineCore, "draw", "engine: draw", "engine: drawn")
        _wrap(core.EngineCore, "process", "engine: process", "engine: processed")
        send = child.PipeEnd.send

        def send_stamped(self, msg):  # the step's outputs only (heartbeats and replies share the pipe)
            outputs = isinstance(msg, child.wire.Outputs)
            if outputs:
                _stamps.append(("engine: outputs send", time.monotonic()))
            send(self, msg)
            if outputs:
                _stamps.append(("engine: outputs sent", time.monotonic()))
        child.PipeEnd.send = send_stamped
        if os.environ.get("SERVE_TIMELINE_CONSTANT"):
            import torch
            cache = {}
            handle = child.EngineProcessServer.handle

            def patched(self, msg):
                if "on" not in cache:
                    cache["on"] = True
                    vocab = getattr(self.engine.core.runner.model, "vocab_size", self.engine.vocab_size)

                    def forward(fb):
                        n = int(fb.logits_indices.shape[0])
                        if n not in cache:
                            cache[n] = torch.randn(n, vocab, generator=torch.Generator().manual_seed(n))
                        return cache[n]
                    self.engine._run_on_loop(lambda: setattr(self.engine.core.runner, "forward", forward))
                return handle(self, msg)
            child.EngineProcessServer.handle = patched

    def _server_side():
        from uvicorn.protocols.http import httptools_impl
        from prefixrt.engine import api
        from prefixrt.engine.process import client
        from prefixrt.server import body, sse
        _wrap(httptools_impl.HttpToolsProtocol, "data_received", "server: bytes in")
        _wrap(body, "loads_json", "server: body parse", "server: body parsed")
        try:
            from prefixrt.server import openai_api, openai_format
            _wrap(openai_api, "lower_completion_request", "server: handler")
            text_events = openai_format.TextEvents
        except ImportError:  # a checkout from before prefixrt/lowering/ (for a before / after)
            from prefixrt.server import convert
            _wrap(convert, "completion_params", "server: handler")
            text_events = convert.TextEvents
        _wrap(api.EngineAPI, "astream_open", "server: open stream")
        _wrap(client.ProcessEngine, "_submit", "server: submit", "server: submitted")
        try:
            from prefixrt.engine.process import pipe_writer
            _wrap(pipe_writer.PipeWriter, "_write_without_blocking", "server: pipe write (loop)")
            _wrap(pipe_writer.PipeWriter, "_write_queue", "server: pipe write (thread)")
        except ImportError:  # a checkout from before engine/process/pipe_writer.py (for a before / after)
            _wrap(client.ProcessEngine, "_write_outbox", "server: pipe write (thread)")
        _wrap(client.ProcessEngine, "_deliver", "server: outputs in")
        _wrap(text_events, "event", "server: SSE event")

    def _install(*_):
        if "prefixrt.server.app" in sys.modules:
            _server_side()
        elif "prefixrt.engine.process.child" in sys.modules:
            _engine_side()

    def _save(*_):
        with open(os.path.join(_dir, f"{os.getpid()}.json"), "w") as f:
            json.dump(_stamps, f)
    signal.signal(signal.SIGUSR1, _install)
    signal.signal(signal.SIGUSR2, _save)
'''


def table(windows, stamps) -> list[tuple[str, float, float, int]]:
    """(stage, p50 ms, min ms, requests seen) in time order of the p50s, the client's first event included."""
    rows = []
    for t0, first, end in windows:
        seen = {"client: first event": (first - t0) * 1e3}
        for label, t in stamps:
            if t0 <= t <= end and label not in seen:
                seen[label] = (t - t0) * 1e3
        rows.append(seen)
    labels = {k for r in rows for k in r}
    out = [(k, statistics.median(xs), min(xs), len(xs))
           for k in labels for xs in [[r[k] for r in rows if k in r]]]
    return sorted(out, key=lambda row: row[1])


def main() -> None:
    ap = script_parser(__doc__)
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--shared", type=int, default=3500)
    ap.add_argument("--new", type=int, default=80)
    ap.add_argument("--vocab", type=int, default=300, help="prompt ids are drawn from [16, vocab)")
    ap.add_argument("--model", help="a checkpoint folder (default: the tiny CPU Llama)")
    ap.add_argument("--constant-logits", action="store_true")
    ap.add_argument("serve_args", nargs="*", help="after --: more `prefixrt serve` arguments")
    args = ap.parse_args()
    from benchmarks.gpu_server import Server, hot_request_windows

    root = Path(tempfile.mkdtemp(prefix="serve-timeline-"))
    serve_args = list(args.serve_args)
    model = args.model
    if model is None:
        path = tiny_model_dir(root)
        config = json.loads((path / "config.json").read_text())
        config["max_position_embeddings"] = max(config["max_position_embeddings"], 2 * (args.shared + args.new))
        (path / "config.json").write_text(json.dumps(config))
        model, serve_args = str(path), ["--device", "cpu", "--kv-cache-tokens", "20000", *serve_args]
    boot, stamps_dir = root / "boot", root / "stamps"
    boot.mkdir()
    stamps_dir.mkdir()
    (boot / "sitecustomize.py").write_text(BOOT)
    os.environ["SERVE_TIMELINE_DIR"] = str(stamps_dir)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(boot), os.environ.get("PYTHONPATH")) if p)
    if args.constant_logits:
        os.environ["SERVE_TIMELINE_CONSTANT"] = "1"
    srv = Server(model, serve_args, root / "serve.log")
    try:
        print(f"server ready in {srv.wait_ready():.1f} s", flush=True)
        srv.signal_all(signal.SIGUSR1)
        time.sleep(0.5)
        # the engine goes idle between requests (20 ms), as in the TTFT benchmark
        windows = hot_request_windows(srv.url, args.shared, args.new, args.requests, args.vocab, pause_s=0.02)
        srv.signal_all(signal.SIGUSR2)
        time.sleep(1.0)
        stamps = [tuple(s) for f in stamps_dir.glob("*.json") for s in json.loads(f.read_text())]
    finally:
        srv.stop()
    print(f"{'stage':32s} {'p50 ms':>8s} {'min ms':>8s}   (after the client began; {args.requests} requests)")
    for label, p50, lo, n in table(windows, stamps):
        print(f"{label:32s} {p50:8.2f} {lo:8.2f}" + ("" if n == len(windows) else f"   (in {n})"))


if __name__ == "__main__":
    sys.exit(main())
