"""`prefixrt.adapters.litellm.register`: DSPy through `dspy.LM("openai/<name>", api_base=<prefixrt serve>)` gets
no response schema for a name litellm's model map (and DSPy's copy of it) does not know, so JSONAdapter falls
back; after the one-line register, DSPy sends its schema on both of its routes (native and litellm) and typed
fields parse. Against the tiny model's live server."""

from __future__ import annotations

from typing import Literal

import pytest

dspy = pytest.importorskip("dspy")
pytest.importorskip("litellm")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


class Check(dspy.Signature):
    question: str = dspy.InputField()
    answer: int = dspy.OutputField()
    ok: bool = dspy.OutputField()
    kind: Literal["easy", "hard"] = dspy.OutputField()


def _lms(url: str):
    kw = {"api_base": url + "/v1", "api_key": "unused", "max_tokens": 48, "temperature": 0.0}
    return [dspy.LM("openai/tiny-llama", **kw), dspy.LM("openai/tiny-llama", engine="litellm", **kw)]


def test_register_makes_dspy_send_the_schema(tiny_server, monkeypatch):
    from dspy.clients.capabilities import capabilities
    from prefixrt.adapters.litellm import register

    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network: the maps' packaged copies
    assert [capabilities(lm).response_schema for lm in _lms(tiny_server)] == [False, False]  # the gap

    assert register(base_url=tiny_server) == ["tiny-llama"]

    for lm in _lms(tiny_server):
        assert capabilities(lm).response_schema and "response_format" in lm.supported_params
        with dspy.context(lm=lm, adapter=dspy.JSONAdapter()):
            out = dspy.Predict(Check)(question="Is 2 + 2 = 4?")
        assert isinstance(out.answer, int) and isinstance(out.ok, bool) and out.kind in ("easy", "hard")
        assert len(lm.history) == 1, [h["outputs"] for h in lm.history]  # parsed on the first call
        fmt = lm.history[0]["kwargs"].get("response_format")
        assert fmt is not None and fmt != {"type": "json_object"}, fmt  # the signature's schema was sent


def test_register_needs_names():
    from prefixrt.adapters.litellm import register

    with pytest.raises(ValueError):
        register()
    assert register("some-served-name") == ["some-served-name"]
    import litellm

    assert litellm.supports_response_schema(model="openai/some-served-name", custom_llm_provider="openai")
