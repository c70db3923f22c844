"""Access control (issue 10, item 8 / build 7): `--api-key` / `--admin-api-key` on `prefixrt serve`.

Without the key every route but /health answers 401 with an OpenAI error object and nothing reaches the engine;
with the user key the administrative routes answer 403; the admin key opens them. The real `openai` client,
RemoteEngine and the frontend on top of it send the key.
"""

from __future__ import annotations

import subprocess

import httpx
import openai
import pytest

from tests.reliability.conftest import assert_error_shape
from tests.server.conftest import ServeProcess, cli, cli_env

USER, ADMIN = "user-key-123", "admin-key-456"

USER_ROUTES = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/chat/completions", {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("POST", "/v1/completions", {"model": "tiny-llama", "prompt": "hi", "max_tokens": 2}),
    ("POST", "/generate", {"prompt": "hi", "sampling_params": {"max_new_tokens": 2}}),
    ("POST", "/abort", {"request_id": "nothing-running"}),
    ("GET", "/openapi.json", None),
]
ADMIN_ROUTES = [
    ("POST", "/flush_cache", None),
    ("POST", "/cache_prefix", {"prompt": "The quick brown"}),
    ("GET", "/stats", None),
    ("GET", "/metrics", None),
    ("GET", "/dashboard", None),
]


@pytest.fixture(scope="module")
def keyed_server(model_dirs, tmp_path_factory):
    args = ["--model", str(model_dirs("llama")), "--served-model-name", "tiny-llama", "--device", "cpu", "--kv-cache-tokens", "4096", "--log-level",
            "warning", "--api-key", USER, "--admin-api-key", ADMIN]
    with ServeProcess(args, tmp_path_factory.mktemp("auth") / "serve.log") as live:
        yield live


def _call(url: str, method: str, path: str, body, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, url + path, json=body, headers=headers, timeout=60)


def _engine_requests(url: str) -> int:
    return _call(url, "GET", "/stats", None, ADMIN).json()["requests_total"]


@pytest.mark.parametrize("key", [None, "wrong-key", f"{USER}x"])
def test_without_the_key_every_route_but_health_is_401(keyed_server, key):
    before = _engine_requests(keyed_server.url)
    for method, path, body in USER_ROUTES + ADMIN_ROUTES:
        r = _call(keyed_server.url, method, path, body, key)
        assert r.status_code == 401, (path, r.status_code, r.text)
        err = assert_error_shape(r.json())
        assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key", err
        assert r.headers["www-authenticate"] == "Bearer"
    assert _engine_requests(keyed_server.url) == before  # nothing reached the engine
    assert httpx.get(keyed_server.url + "/health", timeout=30).status_code == 200


def test_user_key_opens_user_routes_and_is_403_on_admin_routes(keyed_server):
    for method, path, body in USER_ROUTES:
        r = _call(keyed_server.url, method, path, body, USER)
        assert r.status_code == 200, (path, r.text)
    for method, path, body in ADMIN_ROUTES:
        r = _call(keyed_server.url, method, path, body, USER)
        assert r.status_code == 403, (path, r.status_code, r.text)
        assert assert_error_shape(r.json())["type"] == "permission_error"


def test_admin_key_opens_everything(keyed_server):
    for method, path, body in USER_ROUTES + ADMIN_ROUTES:
        r = _call(keyed_server.url, method, path, body, ADMIN)
        assert r.status_code == 200, (path, r.status_code, r.text)


def test_clients_send_the_key(keyed_server, monkeypatch):
    from prefixrt import RemoteEngine, function, gen, user

    good = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key=USER, max_retries=0)
    assert good.completions.create(model="tiny-llama", prompt="hi", max_tokens=2).usage.completion_tokens <= 2
    bad = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny-llama", prompt="hi", max_tokens=2)
    good.close()
    bad.close()

    with RemoteEngine(keyed_server.url, api_key=USER) as remote:
        assert remote.generate("hi", {"max_new_tokens": 2}).completion_tokens <= 2
        assert [c.finish_reason for c in remote.stream("hi", {"max_new_tokens": 2})][-1] == "length"
        with pytest.raises(PermissionError, match="403"):
            remote.stats()
    with RemoteEngine(keyed_server.url) as anonymous, pytest.raises(PermissionError, match="401"):
        anonymous.generate("hi", {"max_new_tokens": 2})
    monkeypatch.setenv("PREFIXRT_API_KEY", ADMIN)
    with RemoteEngine(keyed_server.url) as from_env:
        assert from_env.stats().requests_total > 0

    @function
    def hello(s):
        s += user("Say hi.") + gen("answer", max_tokens=3)

    with RemoteEngine(keyed_server.url, api_key=ADMIN) as remote:
        state = hello.run(backend=remote)
        assert isinstance(state["answer"], str)


def test_api_key_alone_turns_admin_routes_off(model_dirs, tiny_checkpoints, tiny_tokenizer):
    """With --api-key but no --admin-api-key, the administrative routes are off (403), not open."""
    from starlette.testclient import TestClient

    from prefixrt.server.app import create_app
    from tests.server.conftest import build_engine

    eng = build_engine(tiny_checkpoints, tiny_tokenizer, kv_cache_tokens=1024)
    try:
        http = TestClient(create_app(eng, api_key=USER))
        auth = {"Authorization": f"Bearer {USER}"}
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=auth).status_code == 200
        r = http.post("/flush_cache", headers=auth)
        assert r.status_code == 403 and "--admin-api-key" in r.json()["error"]["message"]
        assert http.get("/stats").status_code == 401
        only_admin = TestClient(create_app(eng, admin_api_key=ADMIN))  # user routes open, admin routes keyed
        assert only_admin.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        assert only_admin.get("/stats").status_code == 401
        assert only_admin.get("/stats", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200
    finally:
        eng.shutdown()


def test_env_keys_and_non_loopback_warning(monkeypatch):
    from prefixrt.cli import build_parser

    monkeypatch.setenv("PREFIXRT_API_KEY", "from-env")
    monkeypatch.setenv("PREFIXRT_ADMIN_API_KEY", "admin-from-env")
    args = build_parser().parse_args(["serve"])
    assert args.api_key == "from-env" and args.admin_api_key == "admin-from-env"

    env = {k: v for k, v in cli_env().items() if k not in ("PREFIXRT_API_KEY", "PREFIXRT_ADMIN_API_KEY")}
    run = subprocess.run(cli("serve", "--host", "0.0.0.0", "--model", "/nonexistent/model"), env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "WARNING" in run.stderr and "without an API key" in run.stderr, run.stderr
    run = subprocess.run(cli("serve", "--host", "0.0.0.0", "--model", "/nonexistent/model", "--api-key", "k"),
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "WARNING" not in run.stderr, run.stderr
