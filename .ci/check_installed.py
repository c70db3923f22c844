"""Checks an installed prefixrt (a wheel in a venv of its own) the way a user meets it; .ci/check_wheel.sh runs it.

Run with `python -I` from a folder outside the checkout, in a venv where only the wheel is installed (its
dependencies come from another venv's site-packages, named by a plain path line in a .pth file). It checks:
1. prefixrt is the installed copy: no checkout folder, editable finder or source-tree finder reaches it;
2. every module the wheel installed imports (read from the distribution's file list: pkgutil would pass over
   prefixrt.kernels / prefixrt.adapters, whose folders have no __init__.py), except those of OPTIONAL_IMPORTS
   when the dependency they name is absent;
3. `prefixrt --help`, `prefixrt models`, `python -m prefixrt.cli --help`;
4. prefixrt.Engine(MODEL) greedy tokens equal transformers' own greedy tokens on the same checkpoint;
5. `prefixrt generate` and `prefixrt serve` (one /v1/completions request, then SIGTERM: a clean exit) answer
   the same text as the Engine.

Usage: python -I check_installed.py MODEL_FOLDER
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

# module -> the optional distribution without which it cannot import (none today: CI installs every extra).
# A module listed here may fail only with ModuleNotFoundError of exactly that top-level name.
OPTIONAL_IMPORTS: dict[str, str] = {}

PROMPT = "The quick brown fox"
NEW_TOKENS = 8


def check_isolation() -> None:
    """Nothing but the installed copy of prefixrt can be imported: no source tree on sys.path, no editable
    install's finder, no source-tree finder (an installed prefixrt never installs one)."""
    import prefixrt.kernels  # (binds prefixrt too)

    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    package = Path(prefixrt.__file__).resolve().parent
    assert package == site / "prefixrt", f"prefixrt imported from {package}, not from the venv's {site}"
    trees = [e for e in sys.path if Path(e or os.getcwd()).resolve() != site
             and (Path(e or os.getcwd()) / "prefixrt" / "__init__.py").is_file()]
    assert not trees, f"sys.path entries holding a prefixrt source tree: {trees}"
    finders = [type(f).__module__ + "." + type(f).__name__ for f in sys.meta_path]
    assert not [f for f in finders if "editable" in f or "SourceTreeFinder" in f], finders
    assert [Path(p).resolve() for p in prefixrt.kernels.__path__] == [package / "kernels"], prefixrt.kernels.__path__
    print(f"prefixrt {importlib.metadata.version('prefixrt')} from {package}; nothing else on sys.path holds it")


def installed_modules() -> list[str]:
    """Every module of the installed distribution, from its RECORD (skipping __main__ modules, which run)."""
    names = []
    for f in importlib.metadata.files("prefixrt"):
        parts = f.parts
        if parts[0] != "prefixrt" or f.suffix != ".py":
            continue
        dotted = [*parts[:-1], f.stem] if f.stem != "__init__" else list(parts[:-1])
        if dotted[-1] != "__main__":
            names.append(".".join(dotted))
    return sorted(names)


def import_everything() -> None:
    import pkgutil

    import prefixrt

    modules = installed_modules()
    walked = {m.name for m in pkgutil.walk_packages(prefixrt.__path__, "prefixrt.") if not m.name.endswith("__main__")}
    assert walked <= set(modules), f"pkgutil finds modules the distribution did not install: {walked - set(modules)}"
    failed, optional = [], []
    for name in modules:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if OPTIONAL_IMPORTS.get(name) == (e.name or "").split(".")[0]:
                optional.append(f"{name} (needs {e.name})")
            else:
                failed.append(f"{name}: {type(e).__name__}: {e}")
        except Exception as e:  # any other failure is a defect of the installed package: report them all
            failed.append(f"{name}: {type(e).__name__}: {e}")
    assert not failed, "modules that do not import from the wheel:\n" + "\n".join(failed)
    for name in ("prefixrt.multimodal", "prefixrt.speculative", "prefixrt.bench.programs", "prefixrt.kernels.reference",
                 "prefixrt.adapters.dspy", "prefixrt.server.dashboard"):
        assert name in modules, f"{name} is not in the installed distribution"
    from importlib.resources import files

    assert "<html" in files("prefixrt.server").joinpath("dashboard.html").read_text(encoding="utf-8").lower()
    print(f"{len(modules)} modules imported ({len(walked)} of them found by pkgutil)"
          + (f"; optional, not installed: {', '.join(optional)}" if optional else ""))


def run(*args: str, timeout: float = 300) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def check_cli() -> None:
    bin_dir = Path(sys.executable).parent
    assert "serve" in run(str(bin_dir / "prefixrt"), "--help")
    models = run(str(bin_dir / "prefixrt"), "models")
    assert "smollm2-135m-instruct" in models and "gemma-3-270m" in models, models
    assert "generate" in run(sys.executable, "-m", "prefixrt.cli", "--help")
    print("prefixrt --help, prefixrt models, python -m prefixrt.cli --help: ok")


def check_engine(model: Path) -> str:
    """Engine greedy tokens == transformers' greedy tokens; returns the Engine's text for PROMPT (EOS allowed)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import prefixrt

    ids = AutoTokenizer.from_pretrained(model)(PROMPT)["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                           do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
    eng = prefixrt.Engine(str(model), device="cpu", dtype="float32", kv_cache_tokens=4096)
    try:
        got = eng.generate(ids, {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True})
        assert got.token_ids == want, f"Engine greedy {got.token_ids} != transformers {want}"
        text = eng.generate(PROMPT, {"max_new_tokens": NEW_TOKENS, "temperature": 0}).text
    finally:
        eng.shutdown()
    assert text, "the tiny checkpoint answers nothing to the prompt: the checks below would compare empty texts"
    print(f"Engine: greedy tokens equal transformers' ({want}); text {text!r}")
    return text


def check_generate(model: Path, want: str) -> None:
    out = run(str(Path(sys.executable).parent / "prefixrt"), "generate", PROMPT, "--model", str(model),
              "--device", "cpu", "--dtype", "float32", "--kv-cache-tokens", "4096", "--max-tokens", str(NEW_TOKENS))
    assert out == want + "\n", f"prefixrt generate printed {out!r}, the Engine answered {want!r}"
    print("prefixrt generate: the Engine's text")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_serve(model: Path, want: str, log_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [str(Path(sys.executable).parent / "prefixrt"), "serve", "--model", str(model), "--device", "cpu",
            "--dtype", "float32", "--kv-cache-tokens", "4096", "--served-model-name", "tiny", "--port", str(port)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, "prefixrt serve exited:\n" + log_path.read_text()[-4000:]
            assert time.monotonic() < deadline, "prefixrt serve did not come up:\n" + log_path.read_text()[-4000:]
            time.sleep(0.2)
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0}
        request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as r:
            text = json.loads(r.read())["choices"][0]["text"]
        assert text == want, f"prefixrt serve answered {text!r}, the Engine {want!r}"
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        assert code == 0, f"prefixrt serve exited {code} on SIGTERM:\n" + log_path.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    print("prefixrt serve: /v1/completions answers the Engine's text; SIGTERM exits 0")


def main() -> int:
    model = Path(sys.argv[1]).resolve()
    seconds: dict[str, float] = {}

    def timed(title: str, fn, *args):
        print(f"-- {title}", flush=True)
        t = time.perf_counter()
        out = fn(*args)
        seconds[title] = time.perf_counter() - t
        return out

    timed("isolation", check_isolation)
    timed("import every module", import_everything)
    timed("CLI", check_cli)
    want = timed("Engine vs transformers", check_engine, model)
    timed("prefixrt generate", check_generate, model, want)
    timed("prefixrt serve", check_serve, model, want, Path.cwd() / "serve.log")
    print("installed-wheel checks passed: " + ", ".join(f"{k} {v:.1f}s" for k, v in seconds.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
