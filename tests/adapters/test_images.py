"""Image content blocks through the LangChain adapter into a tiny VLM engine: the reply equals Engine.generate
on the same image and question; a text-only model refuses them."""

from __future__ import annotations

import base64

import pytest
from langchain_core.messages import HumanMessage, SystemMessage
from prefixrt.adapters.langchain import ChatPrefixRT

from prefixrt.errors import InvalidRequest
from tests.helpers.images import ask, data_url, png_bytes, random_image

QUESTION = "What is the capital?"


def blocks(image) -> list[list[dict]]:
    b64 = base64.b64encode(png_bytes(image)).decode()
    return [
        [{"type": "image", "source_type": "base64", "mime_type": "image/png", "data": b64}],
        [{"type": "image", "base64": b64, "mime_type": "image/png"}],
        [{"type": "image_url", "image_url": {"url": data_url(image)}}],
    ]


def test_langchain_image_blocks(make_vlm):
    eng = make_vlm()
    image = random_image(81)
    want = eng.generate(ask(QUESTION, image), {"max_new_tokens": 6, "temperature": 0.0, "detokenize": True}).text
    chat = ChatPrefixRT(engine=eng, max_tokens=6, temperature=0.0)
    for block in blocks(image):
        reply = chat.invoke([HumanMessage(content=block + [{"type": "text", "text": QUESTION}])])
        assert reply.content == want
    with_system = chat.invoke([SystemMessage(content="Be brief."),
                               HumanMessage(content=blocks(image)[0] + [{"type": "text", "text": QUESTION}])])
    assert with_system.content  # the system note and the image coexist


def test_text_model_refuses_image_blocks(make_engine):
    chat = ChatPrefixRT(engine=make_engine("llama"), max_tokens=4, temperature=0.0)
    with pytest.raises(InvalidRequest, match="takes no images"):
        chat.invoke([HumanMessage(content=blocks(random_image(1))[0] + [{"type": "text", "text": "hi"}])])


def test_dspy_image_field(make_vlm):
    """A dspy.Image input field reaches the vision tower; the reply parses (the adapter's format constraint)."""
    import dspy

    import prefixrt

    eng = make_vlm()
    lm = prefixrt.LM(engine=eng, max_tokens=48, temperature=0.0)

    class Describe(dspy.Signature):
        """Answer the question about the image."""

        image: dspy.Image = dspy.InputField()
        question: str = dspy.InputField()
        answer: str = dspy.OutputField()

    model = eng._built.model
    with dspy.context(lm=lm, adapter=dspy.ChatAdapter()):
        pred = dspy.Predict(Describe)(image=dspy.Image(data_url(random_image(91))), question=QUESTION)
        assert isinstance(pred.answer, str)
        assert model.vision_runs == 1
        dspy.Predict(Describe)(image=dspy.Image(data_url(random_image(91))), question="Where is the fox?")
    assert model.vision_runs == 1  # the second question about the same image: encoder output from the cache
