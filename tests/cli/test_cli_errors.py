"""CLI mistakes give one clear line on stderr and a non-zero exit, never a traceback — and the cheap ones are
caught before the model loads (a busy port fails in about a second, not after loading the model)."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time

import pytest

from tests.server.conftest import cli, cli_env


def _run(*args: str, env: dict | None = None, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    r = subprocess.run(cli(*args), env=env or cli_env(), capture_output=True, text=True, timeout=timeout)
    return r, time.monotonic() - started


def _import_blocker(package: str) -> str:
    """Python source that makes `package` (and its submodules) unimportable, as in an installation without it."""
    return textwrap.dedent(f"""
        import sys
        class _Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == {package!r}:
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
                return None
        sys.meta_path.insert(0, _Block())
    """)


def _assert_one_line(r: subprocess.CompletedProcess, *needles: str) -> str:
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("[prefixrt")]
    assert len(lines) == 1, r.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_serve_on_a_busy_port_fails_before_loading_the_model(model_dirs):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r, seconds = _run("serve", "--model", str(model_dirs("llama")), "--port", str(port))
    _assert_one_line(r, f"127.0.0.1:{port}", "--port")
    assert "starting engine" not in r.stderr  # nothing was loaded
    print(f"busy port: exit {r.returncode} after {seconds:.2f} s")
    assert seconds < 10


def test_serve_port_out_of_range():
    r, _ = _run("serve", "--port", "99999")
    _assert_one_line(r, "--port", "65535")
    assert "starting engine" not in r.stderr


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_unknown_model_name(command):
    args = [command, "--model", "no-such-model"] + (["hi"] if command == "generate" else ["--port", "0"])
    r, _ = _run(*args)
    _assert_one_line(r, "unknown model 'no-such-model'", "smollm2-135m-instruct")
    assert "starting engine" not in r.stderr


def test_missing_folder():
    r, _ = _run("generate", "hi", "--model", "/nonexistent/model-folder")
    _assert_one_line(r, "no folder at '/nonexistent/model-folder'")


def test_dummy_shape_without_load_format_names_the_flag():
    r, _ = _run("generate", "hi", "--model", "llama-3-8b")
    line = _assert_one_line(r, "--load-format dummy")
    assert "load_format=" not in line  # the CLI spelling, not the Python one


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message on a CPU-only torch")
def test_cuda_device_on_cpu_torch():
    r, _ = _run("generate", "hi", "--device", "cuda")
    _assert_one_line(r, "--device cuda", "--device cpu")


def test_serve_without_the_server_extra_names_the_pip_command(tmp_path):
    # A site hook that makes uvicorn unimportable, as in an installation without prefixrt[server].
    (tmp_path / "sitecustomize.py").write_text(_import_blocker("uvicorn"))
    env = cli_env()
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    r, _ = _run("serve", "--port", "0", env=env)
    _assert_one_line(r, "'uvicorn'", "pip install 'prefixrt[server]'")


def test_openai_shim_without_httpx_names_the_pip_command(tmp_path):
    code = _import_blocker("httpx") + textwrap.dedent("""
        try:
            import prefixrt.openai
        except ModuleNotFoundError as e:
            print(e)
    """)
    r = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, timeout=120)
    assert "pip install 'prefixrt[openai,server]'" in r.stdout, r.stdout + r.stderr


def test_cascade_decode_flag_reaches_the_engine_config():
    import argparse

    from prefixrt.config.engine_config import EngineConfig
    from prefixrt.config.flags import add_engine_args, engine_kwargs
    from prefixrt.engine.builder import CASCADE_DECODE, cascade_enabled

    p = argparse.ArgumentParser()
    add_engine_args(p)
    for argv, want in (([], CASCADE_DECODE), (["--cascade-decode"], True), (["--no-cascade-decode"], False)):
        kw = engine_kwargs(p.parse_args(argv))
        assert cascade_enabled(EngineConfig(**{k: v for k, v in kw.items() if k in EngineConfig.__dataclass_fields__})) is want
