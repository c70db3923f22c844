"""The commands that serve nothing (`prefixrt models`, `bench`, `chat`, `generate`) never import prefixrt.server:
each runs to completion in one fresh interpreter on a tiny local model, and after each the interpreter's modules
are checked."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.server.conftest import cli_env

RUN = textwrap.dedent("""
    import io, json, sys
    from prefixrt.cli import main

    loaded = {}
    for name, argv, stdin in json.loads(sys.argv[1]):
        sys.stdin = io.StringIO(stdin)
        rc = main(argv)
        assert rc == 0, (name, rc)
        loaded[name] = sorted(m for m in sys.modules if m == "prefixrt.server" or m.startswith("prefixrt.server."))
    print("LOADED " + json.dumps(loaded))
""")


def test_non_serving_commands_do_not_import_the_server(model_dirs):
    model = str(model_dirs("llama"))
    engine = ["--model", model, "--device", "cpu", "--kv-cache-tokens", "1024"]
    commands = [
        ("models", ["models"], ""),
        ("bench", ["bench", "--workload", "random", "--requests", "2", "--input-len", "8", "--output-len", "2",
                   "--baselines", "radix", "--no-progress", *engine], ""),
        ("chat", ["chat", *engine, "--max-tokens", "2"], "hello\n/exit\n"),
        ("generate", ["generate", "The quick brown", *engine, "--max-tokens", "2"], ""),
    ]
    r = subprocess.run([sys.executable, "-c", RUN, json.dumps(commands)], env=cli_env(), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    loaded = json.loads(r.stdout.rsplit("LOADED ", 1)[1])
    assert loaded == {name: [] for name, _, _ in commands}, loaded
