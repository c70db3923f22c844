"""A kept prefix is a contract, through the real openai and anthropic SDKs against `prefixrt serve` with a small
KV pool and host tier: a prefix kept with Anthropic's cache_control or OpenAI's prompt_cache_breakpoint survives a
flood that overflows both tiers several times over (its next request reports >= 99% of it cached), while an
unkept prefix of the same size in the same flood is evicted; a keep over the tenant's share is refused and the
response says so (header and metric); /metrics reports pinned tokens per tier."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import SERVED_NAME, ServeProcess
from tests.server.test_anthropic_api import long_model_folder  # noqa: F401 (a fixture)

POOL, HOST = 1024, 2048  # tokens; the per-tenant share of kept prefixes: 25% of the host tier (512)


def system_text(tag: str, words: int = 40) -> str:
    """About 9 tokens a word of the tiny tokenizer (40 words: ~360 tokens)."""
    return " ".join(f"{tag}{k % 10} rule" for k in range(words)) + "."


@pytest.fixture(scope="module")
def server(long_model_folder, tmp_path_factory):  # noqa: F811
    args = ["--model", str(long_model_folder), "--served-model-name", SERVED_NAME, "--device", "cpu",
            "--kv-cache-tokens", str(POOL), "--host-kv-cache-tokens", str(HOST), "--log-level", "warning"]
    with ServeProcess(args, tmp_path_factory.mktemp("serve") / "serve.log") as live:
        yield live
        s = live.wait_idle()
        assert s["kv_locked"] == 0 and s["kv_free"] + s["kv_evictable"] == s["kv_total"], s
        assert "Traceback" not in live.log(), live.log()


@pytest.fixture(scope="module")
def clients(server):
    a = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    o = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    yield a, o
    a.close()
    o.close()


def metric(server, name: str, labels: str = "") -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    line = next(x for x in text.splitlines() if x.startswith(name + labels + " "))
    return float(line.split()[-1])


def test_kept_prefixes_survive_a_flood_of_both_tiers_and_unkept_ones_do_not(server, clients):
    a, o = clients
    sys_a, sys_b, sys_c, sys_d = (system_text(t) for t in ("ka", "ub", "kc", "ud"))
    # Anthropic: one prefix kept for an hour (cache_control on the system prompt), one not
    kept_a = a.messages.create(model=SERVED_NAME, max_tokens=2, messages=[{"role": "user", "content": "first"}],
                               system=[{"type": "text", "text": sys_a,
                                        "cache_control": {"type": "ephemeral", "ttl": "1h"}}])
    kept_a_tokens = kept_a.usage.cache_creation_input_tokens
    assert 300 < kept_a_tokens < 512
    a.messages.create(model=SERVED_NAME, max_tokens=2, system=sys_b, messages=[{"role": "user", "content": "first"}])
    # OpenAI: one kept by a block breakpoint (explicit mode: nothing else is kept), one not
    raw = o.chat.completions.with_raw_response.create(
        model=SERVED_NAME, max_tokens=2, prompt_cache_key="session-c", prompt_cache_options={"mode": "explicit"},
        messages=[{"role": "system", "content": [{"type": "text", "text": sys_c,
                                                  "prompt_cache_breakpoint": {"mode": "explicit"}}]},
                  {"role": "user", "content": "first"}])
    kept_c_tokens = int(raw.headers["x-prompt-cache-keep"].removeprefix("kept="))
    assert 300 < kept_c_tokens < 512
    first_d = o.chat.completions.create(model=SERVED_NAME, max_tokens=2, messages=[
        {"role": "system", "content": sys_d}, {"role": "user", "content": "first"}])
    prompt_d = first_d.usage.prompt_tokens
    # the flood: distinct prompts of about 800 tokens each, 4x the pool and host tier together
    for k in range(16):
        o.chat.completions.create(model=SERVED_NAME, max_tokens=1, messages=[
            {"role": "user", "content": system_text(f"f{k}x", 90)}])
    stats = httpx.get(server.url + "/stats", timeout=30).json()
    assert stats["evicted_tokens_total"] > 8 * POOL and stats["host_evicted_tokens_total"] > 3 * HOST
    # both in the host tier (their shared head, the template's opening tokens, counts once)
    assert stats["pins"] == 2 and kept_a_tokens + kept_c_tokens - 32 <= stats["pinned_tokens_host"]
    assert metric(server, "prefixrt_pinned_tokens", '{tier="host"}') == stats["pinned_tokens_host"]
    # the next turn of each
    again_a = a.messages.create(model=SERVED_NAME, max_tokens=2, messages=[{"role": "user", "content": "second"}],
                                system=[{"type": "text", "text": sys_a,
                                         "cache_control": {"type": "ephemeral", "ttl": "1h"}}])
    assert again_a.usage.cache_read_input_tokens >= 0.99 * kept_a_tokens
    again_b = a.messages.create(model=SERVED_NAME, max_tokens=2, system=sys_b,
                                messages=[{"role": "user", "content": "second"}])
    assert again_b.usage.cache_read_input_tokens < 0.1 * kept_a_tokens
    again_c = o.chat.completions.create(
        model=SERVED_NAME, max_tokens=2, prompt_cache_key="session-c", prompt_cache_options={"mode": "explicit"},
        messages=[{"role": "system", "content": [{"type": "text", "text": sys_c,
                                                  "prompt_cache_breakpoint": {"mode": "explicit"}}]},
                  {"role": "user", "content": "second"}])
    assert again_c.usage.prompt_tokens_details.cached_tokens >= 0.99 * kept_c_tokens
    again_d = o.chat.completions.create(model=SERVED_NAME, max_tokens=2, messages=[
        {"role": "system", "content": sys_d}, {"role": "user", "content": "second"}])
    assert again_d.usage.prompt_tokens_details.cached_tokens < 0.1 * prompt_d


def test_a_keep_over_the_tenants_share_is_refused_with_a_header_and_a_metric(server, clients):
    a, _ = clients
    refused_before = metric(server, "prefixrt_kept_prefixes_refused_total")
    big = system_text("big", 70)  # ~630 tokens: more than one tenant's share of the host tier (512)
    raw = a.messages.with_raw_response.create(
        model=SERVED_NAME, max_tokens=2, extra_body={"cache_salt": "tenant-2"},
        system=[{"type": "text", "text": big, "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": "hi"}])
    header = raw.headers["x-prompt-cache-keep"]
    assert header.startswith("kept=0; refused=") and header.endswith("reason=tenant_limit")
    assert raw.parse().usage.cache_creation_input_tokens == 0  # nothing was written for a breakpoint
    assert metric(server, "prefixrt_kept_prefixes_refused_total") == refused_before + 1
    small = a.messages.with_raw_response.create(
        model=SERVED_NAME, max_tokens=2, extra_body={"cache_salt": "tenant-2"},
        system=[{"type": "text", "text": system_text("sm", 30), "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": "hi"}])
    assert small.headers["x-prompt-cache-keep"].startswith("kept=") and "refused" not in small.headers[
        "x-prompt-cache-keep"]
