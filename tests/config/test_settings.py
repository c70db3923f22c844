"""Settings are declared once (prefixrt/config/): a new engine setting is one `setting(...)` declaration plus its
use, and its flag, its ENGINE_FLAGS entry, its checks and the section its component reads follow from it; the
generated flags keep the command line's spellings (--no-radix-cache, --tp, --cascade-decode / --no-...)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from prefixrt.config.engine_config import SECTIONS, EngineConfig, SchedulerSettings
from prefixrt.config.flags import ENGINE_FLAGS, add_engine_args, engine_flags, engine_kwargs
from prefixrt.config.settings import setting


@dataclasses.dataclass(frozen=True)
class LookaheadScheduling(SchedulerSettings):
    """A scheduler section with one more setting: the whole of what adding it takes."""

    lookahead_steps: int = setting(2, "steps the scheduler plans ahead", choices=(1, 2, 4), flag=True)


@dataclasses.dataclass(frozen=True)
class LookaheadConfig(EngineConfig, LookaheadScheduling):
    pass


def _parse(argv, config_cls=EngineConfig):
    p = argparse.ArgumentParser()
    add_engine_args(p, config_cls=config_cls)
    return p, engine_kwargs(p.parse_args(argv), config_cls)


def test_a_new_setting_is_one_declaration():
    assert "lookahead_steps" not in ENGINE_FLAGS
    assert "lookahead_steps" in engine_flags(LookaheadConfig)  # ENGINE_FLAGS of a config that declares it
    p, kw = _parse(["--lookahead-steps", "4"], LookaheadConfig)
    assert kw["lookahead_steps"] == 4
    assert "steps the scheduler plans ahead" in p.format_help()  # the declaration's help
    assert _parse([], LookaheadConfig)[1]["lookahead_steps"] == 2  # the declaration's default
    with pytest.raises(SystemExit):  # the declaration's choices, at parse time
        _parse(["--lookahead-steps", "3"], LookaheadConfig)
    config = LookaheadConfig(**kw)
    assert config.section(LookaheadScheduling).lookahead_steps == 4  # the section its component reads
    assert config.section(LookaheadScheduling).schedule_policy == "lpm"
    with pytest.raises(ValueError, match="LookaheadConfig: lookahead_steps must be one of"):  # its choices
        LookaheadConfig(lookahead_steps=3)
    with pytest.raises(ValueError, match="LookaheadScheduling: lookahead_steps must be one of"):
        LookaheadScheduling(lookahead_steps=0)


def test_every_setting_is_in_exactly_one_section():
    names = [f.name for s in SECTIONS for f in dataclasses.fields(s)]
    assert len(names) == len(set(names))
    assert sorted(names) == sorted(f.name for f in dataclasses.fields(EngineConfig))
    for f in dataclasses.fields(EngineConfig):
        assert f.metadata.get("help"), f"{f.name} has no help"


def test_generated_flags_keep_the_command_line():
    p, kw = _parse([])
    assert "+0.7-1.1% perplexity" in " ".join(p.format_help().split())  # every declaration's help formats (a % is escaped)
    assert set(kw) == set(ENGINE_FLAGS)
    assert kw["radix_cache"] is True and kw["host_kv_preempt_after_s"] is None and kw["cascade_decode"] is None
    assert kw["tp_size"] == 1 and kw["quantization"] is None and kw["schedule_policy"] == "lpm"
    EngineConfig(**kw)  # the flags' defaults are a valid config
    _, kw = _parse(["--no-radix-cache", "--tp", "2", "--no-cascade-decode", "--host-kv-preempt-after-s", "-1",
                    "--quantization", "fp8", "--kv-cache-tokens", "64", "--mem-fraction", "0.5"])
    assert kw["radix_cache"] is False and kw["tp_size"] == 2 and kw["cascade_decode"] is False
    assert kw["host_kv_preempt_after_s"] is None and kw["quantization"] == "fp8"
    assert kw["kv_cache_tokens"] == 64 and kw["mem_fraction"] == 0.5
    _, kw = _parse(["--tp-size", "4", "--cascade-decode", "--host-kv-preempt-after-s", "0.5", "--debug"])
    assert kw["tp_size"] == 4 and kw["cascade_decode"] is True and kw["host_kv_preempt_after_s"] == 0.5
    assert kw["debug"] is True
    for bad in (["--dtype", "float64"], ["--schedule-policy", "random"], ["--host-kv-prefetch", "never"]):
        with pytest.raises(SystemExit):
            _parse(bad)


def test_checks_name_the_setting():
    with pytest.raises(ValueError, match="^EngineConfig: chunked_prefill_tokens must be >= 1"):
        EngineConfig(chunked_prefill_tokens=0)
    with pytest.raises(ValueError, match="schedule_policy must be one of"):
        EngineConfig(schedule_policy="random")
    with pytest.raises(ValueError, match="kv_cache_tokens must hold at least two pages"):
        EngineConfig(kv_cache_tokens=3, page_size=2)
    with pytest.raises(ValueError, match="SchedulerSettings: max_running_requests must be >= 1"):
        SchedulerSettings(max_running_requests=0)


def test_serve_flags_are_the_server_sections_declarations(monkeypatch):
    """`prefixrt serve` adds its server and disaggregation sections' flags to the engine's, from their declarations
    (server/settings.py): names, aliases, list values and environment defaults."""
    from prefixrt.server.launch import add_serve_args
    from prefixrt.server.settings import DisaggSettings, ServerSettings

    monkeypatch.setenv("PREFIXRT_API_KEY", "k1")
    p = argparse.ArgumentParser()
    add_serve_args(p)
    args = p.parse_args(["--served-model-name", "a", "b", "--graceful-timeout", "5", "--role", "decode"])
    assert args.served_model_name == ["a", "b"] and args.drain_timeout == 5.0 and args.role == "decode"
    assert args.api_key == "k1" and args.admin_api_key is None and args.port == 30000
    defaults = p.parse_args([])
    for section in (ServerSettings, DisaggSettings):
        for f in dataclasses.fields(section):
            assert f.metadata["flag"] and f.metadata["help"] and hasattr(args, f.name), f.name
            if f.name != "api_key":  # (its default is the environment's here)
                assert getattr(defaults, f.name) == f.default, f.name
