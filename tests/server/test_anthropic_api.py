"""The anthropic SDK against `prefixrt serve` (the tiny random-weights model, started as users start it, with an
API key), used as its documentation shows with only base_url and api_key set: messages.create, the streaming
helper, a tool-use loop, count_tokens, prompt caching with cache_control (cache_read_input_tokens > 0 on a
conversation's second call), and Anthropic's error shapes. What the model writes is noise; the checks are on the
protocol: shapes, usage arithmetic, stop reasons, and agreement between the streamed and the whole reply."""

from __future__ import annotations

import json
import shutil

import anthropic
import httpx
import pytest

from tests.server.conftest import SERVED_NAME, ServeProcess, assert_clean, needs_constrained_decoding

KEY = "sk-test-anthropic"
ADMIN = {"x-api-key": "sk-test-admin"}
SYSTEM = [{"type": "text", "text": "You are a careful assistant who answers in one short line. " * 12,
           "cache_control": {"type": "ephemeral"}}]
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                            "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def long_model_folder(model_dirs, tmp_path_factory):
    """The tiny llama with a 2048-token context (its checkpoint says 128; RoPE has no learned positions)."""
    folder = tmp_path_factory.mktemp("long") / "tiny-llama"
    shutil.copytree(model_dirs("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 2048
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def server(long_model_folder, tmp_path_factory):
    args = ["--model", str(long_model_folder), "--served-model-name", SERVED_NAME, "--device", "cpu",
            "--kv-cache-tokens", "16384", "--api-key", KEY, "--admin-api-key", ADMIN["x-api-key"],
            "--log-level", "warning"]
    with ServeProcess(args, tmp_path_factory.mktemp("serve") / "serve.log") as live:
        yield live
        stats = httpx.get(live.url + "/stats", headers=ADMIN, timeout=30).json()
        assert stats["requests_running"] == 0 and stats["requests_waiting"] == 0, stats
        assert stats["kv_free"] + stats["kv_evictable"] + stats["kv_pinned"] == stats["kv_total"], stats
        assert stats["kv_locked"] == 0, stats
        assert "Traceback" not in live.log(), live.log()


@pytest.fixture(scope="module")
def client(server):
    c = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    yield c
    c.close()


def _prompt_total(u) -> int:
    return u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens


def test_create_then_a_second_call_reads_the_cache(client):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What is the capital of France?",
                                          "cache_control": {"type": "ephemeral"}}]}]
    raw = client.messages.with_raw_response.create(model=SERVED_NAME, max_tokens=8, system=SYSTEM, messages=msgs)
    first = raw.parse()
    assert first.type == "message" and first.role == "assistant" and first.model == SERVED_NAME
    assert first.id.startswith("msg_") and first.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in first.content] in (["text"], [])
    assert first.usage.output_tokens <= 8
    # the whole prompt is kept (the breakpoint on its last block): written to the cache, all of it
    total = _prompt_total(first.usage)
    assert raw.headers["x-prompt-cache-keep"] == f"kept={total}"
    assert first.usage.cache_creation_input_tokens + first.usage.cache_read_input_tokens == total
    assert first.usage.input_tokens == 0
    second = client.messages.create(
        model=SERVED_NAME, max_tokens=8, system=SYSTEM,
        messages=msgs + [{"role": "assistant", "content": first.content or "ok"},
                         {"role": "user", "content": "And of Italy?"}])
    assert second.usage.cache_read_input_tokens >= total - 1 > 0
    assert second.usage.cache_creation_input_tokens == 0  # its only breakpoint (the system prompt) was cached
    assert _prompt_total(second.usage) > total


def test_streaming_helper_gives_the_same_message_as_create(server, client):
    msgs = [{"role": "user", "content": "Name three colours."}]
    greedy = {"temperature": 0}  # (the SDK no longer has the argument; the server takes it, as older clients send it)
    whole = client.messages.create(model=SERVED_NAME, max_tokens=12, system=SYSTEM, messages=msgs, extra_body=greedy)
    with client.messages.stream(model=SERVED_NAME, max_tokens=12, system=SYSTEM, messages=msgs,
                                extra_body=greedy) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == (whole.content[0].text if whole.content else "")
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert (final.stop_reason, final.stop_sequence) == (whole.stop_reason, whole.stop_sequence)
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert _prompt_total(final.usage) == _prompt_total(whole.usage)
    # the raw events on the wire, in Anthropic's order (the SDK's iterators leave out the pings)
    with httpx.stream("POST", server.url + "/v1/messages", headers={"x-api-key": KEY}, timeout=60,
                      json={"model": SERVED_NAME, "max_tokens": 4, "messages": msgs, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("event: ")]
    kinds = [line[len("event: "):] for line in lines]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    body = kinds[2:-2]
    if body:
        assert body[0] == "content_block_start" and body[-1] == "content_block_stop"
        assert set(body[1:-1]) == {"content_block_delta"}


def test_stop_sequences_report_the_sequence(client):
    greedy = {"temperature": 0}
    r = client.messages.create(model=SERVED_NAME, max_tokens=40, messages=[{"role": "user", "content": "go"}],
                               extra_body=greedy)
    text = r.content[0].text if r.content else ""
    if len(text) < 4:
        pytest.skip("the random model's greedy reply is too short to stop in")
    stop = text[2:4]
    s = client.messages.create(model=SERVED_NAME, max_tokens=40, messages=[{"role": "user", "content": "go"}],
                               extra_body=greedy, stop_sequences=[stop])
    assert s.stop_reason == "stop_sequence" and s.stop_sequence == stop
    assert s.content[0].text == text[:text.index(stop)]


@needs_constrained_decoding()
def test_tool_use_loop(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.messages.create(model=SERVED_NAME, max_tokens=80, tools=[WEATHER], tool_choice={"type": "any"},
                               messages=messages)
    assert r.stop_reason == "tool_use"
    (call,) = [b for b in r.content if b.type == "tool_use"]
    assert call.name == "get_weather" and set(call.input) == {"city"} and call.id.startswith("toolu_")
    messages += [{"role": "assistant", "content": r.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                               "content": "Sunny, 24 C"}]}]
    final = client.messages.create(model=SERVED_NAME, max_tokens=8, tools=[WEATHER], tool_choice={"type": "none"},
                                   messages=messages)
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert all(b.type == "text" for b in final.content)
    # the tool result turn extends the first call's prompt: its cached tokens show it
    assert final.usage.cache_read_input_tokens > 0
    # a named tool, streamed: the tool_use block arrives whole through input_json_delta
    with client.messages.stream(model=SERVED_NAME, max_tokens=80, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"},
                                messages=[{"role": "user", "content": "Rome?"}]) as stream:
        msg = stream.get_final_message()
    assert msg.stop_reason == "tool_use" and msg.content[0].type == "tool_use"
    assert set(msg.content[0].input) == {"city"}


def test_count_tokens_is_the_prompt_create_reports(client):
    msgs = [{"role": "user", "content": "Count me, please."}]
    n = client.messages.count_tokens(model=SERVED_NAME, system=SYSTEM, messages=msgs)
    r = client.messages.create(model=SERVED_NAME, max_tokens=1, system=SYSTEM, messages=msgs)
    assert n.input_tokens == _prompt_total(r.usage) > 0
    with_tools = client.messages.count_tokens(model=SERVED_NAME, messages=msgs, tools=[WEATHER])
    assert with_tools.input_tokens > client.messages.count_tokens(model=SERVED_NAME, messages=msgs).input_tokens


def test_errors_have_anthropics_shape(server, client):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    too_many = [{"type": "text", "text": f"part {k}", "cache_control": {"type": "ephemeral"}} for k in range(5)]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=SERVED_NAME, max_tokens=4, messages=[{"role": "user", "content": too_many}])
    assert e.value.body["error"]["type"] == "invalid_request_error" and "maximum of 4" in e.value.message
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=SERVED_NAME, max_tokens=4, messages=[{"role": "user", "content": "x"}],
                               tools=[{"type": "web_search_20250305", "name": "web_search"}])
    assert "server tools" in e.value.message
    with pytest.raises(anthropic.BadRequestError):  # the SDK checks max_tokens itself: a raw request then
        client.post("/v1/messages", body={"model": SERVED_NAME, "messages": [{"role": "user", "content": "x"}]},
                    cast_to=httpx.Response)
    bad_key = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad_key.messages.create(model=SERVED_NAME, max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "authentication_error"
    bad_key.close()
    # Bearer works on the Messages routes as x-api-key works on the OpenAI ones
    r = httpx.post(server.url + "/v1/messages/count_tokens", headers={"authorization": f"Bearer {KEY}"},
                   json={"model": SERVED_NAME, "messages": [{"role": "user", "content": "x"}]}, timeout=30)
    assert r.status_code == 200 and r.json()["input_tokens"] > 0
    r = httpx.get(server.url + "/v1/models", headers={"x-api-key": KEY}, timeout=30)
    assert r.status_code == 200


def test_one_hour_breakpoints_are_reported_as_such(client):
    system = [{**SYSTEM[0], "text": "Another system prompt, kept for an hour. " * 8,
               "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    r = client.messages.create(model=SERVED_NAME, max_tokens=2, system=system,
                               messages=[{"role": "user", "content": "hello"}])
    u = r.usage
    assert u.cache_creation_input_tokens > 0 and u.input_tokens > 0  # the user turn is after the breakpoint
    assert u.cache_creation.ephemeral_1h_input_tokens == u.cache_creation_input_tokens
    assert u.cache_creation.ephemeral_5m_input_tokens == 0


def test_server_is_clean_after(server):
    stats = httpx.get(server.url + "/stats", headers=ADMIN, timeout=30).json()
    assert stats["pins"] > 0 and stats["pins_granted_total"] > 0
    assert_clean({**stats, "kv_evictable": stats["kv_evictable"] + stats["kv_pinned"]})
