"""Token continuity (frontend/token_prefix.py): a program's next prompt starts with the exact ids of its previous
prompt and of what the model generated, even where encoding the text again gives other ids; it falls back to
encoding the whole text where the text does not continue them exactly."""

from __future__ import annotations

import pytest

from prefixrt.frontend import ProviderBackend, function, gen
from prefixrt.frontend.token_prefix import TokenPrefix, after_generation, continued_prompt
from prefixrt.outputs import Chunk, Completion


def spelled(tok, text: str) -> list[int]:
    """text as one id per character: a valid spelling that encoding text gives differently (merges)."""
    return [i for ch in text for i in tok.encode(ch, add_special_tokens=False)]


class ScriptedProvider:
    """A Provider whose generations are the given token ids; records every prompt. A stop string cuts the text
    where it occurs, the ids are left whole, as the engine returns them."""

    model_name = "scripted"

    def __init__(self, tokenizer, outputs: list[list[int]]):
        self.tokenizer = tokenizer
        self.outputs = list(outputs)
        self.prompts: list[list[int]] = []
        self.hints: list[list[int]] = []

    def _complete(self, prompt, params) -> Completion:
        self.prompts.append(list(prompt))
        ids = self.outputs.pop(0)
        eos = self.tokenizer.eos_token_id
        text = self.tokenizer.decode([i for i in ids if i != eos])
        matched = eos if ids and ids[-1] == eos else None
        for stop in params.stop or ():
            if stop in text:
                text, matched = text[: text.index(stop)], stop
        return Completion("r", text, list(ids), "stop", matched, prompt_tokens=len(prompt),
                          completion_tokens=len(ids))

    def generate(self, prompt, params):
        if prompt and isinstance(prompt[0], list):
            return [self._complete(p, params) for p in prompt]
        return self._complete(prompt, params)

    def stream(self, prompt, params):
        c = self._complete(prompt, params)
        yield Chunk("r", c.text, c.token_ids[:1])
        yield Chunk("r", "", c.token_ids[1:], c.finish_reason, matched_stop=c.matched_stop,
                    prompt_tokens=c.prompt_tokens, completion_tokens=c.completion_tokens)

    def cache_prefix(self, prompt):
        self.hints.append(list(prompt))
        return len(prompt)


@function
def two_turns(s, stop=None):
    s += "User: hi\nAssistant:"
    s += gen("a", max_tokens=8, stop=stop)
    s += "\nUser: more\nAssistant:"
    s += gen("b", max_tokens=8)


ANSWER = " user error"


def test_the_next_prompt_continues_the_generated_ids_where_encoding_the_text_differs(tiny_tokenizer):
    tok = tiny_tokenizer
    answer = spelled(tok, ANSWER)
    assert tok.encode(ANSWER, add_special_tokens=False) != answer  # re-encoding the answer gives other ids
    provider = ScriptedProvider(tok, [answer, spelled(tok, " ok")])
    be = ProviderBackend(provider)
    state = two_turns.run(backend=be)
    first, second = provider.prompts
    assert second[: len(first) + len(answer)] == first + answer
    text = "User: hi\nAssistant:" + ANSWER + "\nUser: more\nAssistant:"
    assert tok.decode(second, skip_special_tokens=True) == text
    assert second != be.encode(text)  # what the old prompt was: the history re-encoded
    assert state["a"] == ANSWER


@pytest.mark.parametrize("mode", ["stream", "compiled"])
def test_streamed_and_compiled_programs_continue_the_generated_ids(tiny_tokenizer, mode):
    tok = tiny_tokenizer
    answer = spelled(tok, ANSWER)
    provider = ScriptedProvider(tok, [answer, spelled(tok, " ok")])
    be = ProviderBackend(provider)
    if mode == "stream":
        two_turns.run(backend=be, stream=True).sync()
    else:
        two_turns.compile(backend=be).run(backend=be)
    first, second = provider.prompts
    assert second[: len(first) + len(answer)] == first + answer


def test_a_stop_token_and_a_stop_string_are_left_out_of_the_continued_ids(tiny_tokenizer):
    tok = tiny_tokenizer
    answer = spelled(tok, ANSWER)
    provider = ScriptedProvider(tok, [answer + [tok.eos_token_id], spelled(tok, " ok")])
    two_turns.run(backend=ProviderBackend(provider))
    first, second = provider.prompts
    assert second[: len(first) + len(answer) + 1] == first + answer + spelled(tok, "\n")

    # The stop string's tokens (and any after it) are dropped with the text they spell.
    provider = ScriptedProvider(tok, [answer + spelled(tok, "\nUs"), spelled(tok, " ok")])
    state = two_turns.run(backend=ProviderBackend(provider), stop="\n")
    first, second = provider.prompts
    assert state["a"] == ANSWER
    assert second[: len(first) + len(answer) + 1] == first + answer + spelled(tok, "\n")


def test_a_stop_string_ending_inside_a_token_falls_back_to_encoding_the_whole_text(tiny_tokenizer):
    tok = tiny_tokenizer
    er = tok.convert_tokens_to_ids("er")
    assert er != tok.unk_token_id and tok.decode([er]) == "er"
    provider = ScriptedProvider(tok, [spelled(tok, " us") + [er], spelled(tok, " ok")])
    be = ProviderBackend(provider)
    state = two_turns.run(backend=be, stop="r")  # cuts " user" to " use": no prefix of the ids spells that
    assert state["a"] == " use"
    assert provider.prompts[1] == be.encode("User: hi\nAssistant: use\nUser: more\nAssistant:")


def test_fork_branches_and_their_prefix_hint_continue_the_parents_generated_ids(tiny_tokenizer):
    tok = tiny_tokenizer
    answer = spelled(tok, ANSWER)

    @function
    def forked(s):
        s += "User: hi\nAssistant:"
        s += gen("a", max_tokens=8)
        forks = s.fork(2)
        forks += lambda i: f"\nBranch {i}:" + gen("b", max_tokens=4)
        forks.join()

    provider = ScriptedProvider(tok, [answer, spelled(tok, " x"), spelled(tok, " y")])
    forked.run(backend=ProviderBackend(provider))
    first = provider.prompts[0]
    assert provider.hints == [first + answer]
    assert all(p[: len(first) + len(answer)] == first + answer for p in provider.prompts[1:])


def test_a_chat_template_that_renders_the_answer_verbatim_keeps_the_ids_one_that_trims_it_does_not(tiny_tokenizer):
    tok = tiny_tokenizer
    answer = spelled(tok, ANSWER)

    @function
    def chat(s):
        s.user("hi")
        s.assistant(gen("a", max_tokens=8))
        s.user("more")
        s.assistant(gen("b", max_tokens=8))

    provider = ScriptedProvider(tok, [answer, spelled(tok, " ok")])
    chat.run(backend=ProviderBackend(provider))
    first, second = provider.prompts
    assert second[: len(first) + len(answer)] == first + answer

    saved = tok.chat_template
    tok.chat_template = saved.replace("m['content']", "m['content'] | trim")  # " user error" -> "user error"
    try:
        provider = ScriptedProvider(tok, [answer, spelled(tok, " ok")])
        be = ProviderBackend(provider)
        chat.run(backend=be)
    finally:
        tok.chat_template = saved
    second = provider.prompts[1]
    assert second == be.encode(tok.decode(second))  # the whole text encoded, as before


def _dummy_prefix_tokenizer():
    """A sentencepiece-style BPE that prepends "▁" to every string it encodes (Llama-2's dummy prefix)."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.helpers.engines import CORPUS

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    alphabet = sorted(set(CORPUS + string.ascii_letters + string.punctuation + "\n▁"))
    tok.train_from_iterator([CORPUS], trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<bos>", "<eos>"],
                                                          initial_alphabet=alphabet, show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>")


def test_a_tokenizer_with_a_dummy_prefix_falls_back_to_encoding_the_whole_text():
    tok = _dummy_prefix_tokenizer()
    prefix_ids = tok.encode("User: hi", add_special_tokens=False)
    rest_alone = tok.encode("there", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(rest_alone)[0].startswith("▁")  # the hazard: a space that is not in the text
    assert continued_prompt(tok, TokenPrefix("User: hi", tuple(prefix_ids)), "User: hithere") is None
    # A rest that starts with a space is the dummy prefix itself here: continued, and exact.
    ids = continued_prompt(tok, TokenPrefix("User: hi", tuple(prefix_ids)), "User: hi there")
    assert ids is not None and tok.decode(ids) == "User: hi there"

    answer = spelled(tok, " user error")
    provider = ScriptedProvider(tok, [answer, tok.encode(" ok", add_special_tokens=False)])
    be = ProviderBackend(provider)
    two_turns.run(backend=be)
    assert provider.prompts[1] == be.encode(tok.decode(answer).join(["User: hi\nAssistant:", "\nUser: more\nAssistant:"]))


@pytest.mark.parametrize("model", ["gemma-3-270m", "smollm2-135m-instruct", "llama-3-8b"])
def test_embedded_tokenizers_continue_exactly_across_every_kind_of_boundary(model):
    from prefixrt.hub.registry import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(model))
    prompt_text = "Question: what is two and two?\nAnswer:"
    prompt = tok.encode(prompt_text)
    generated = spelled(tok, " four, or é")  # a spelling of its own, not the one encoding it gives
    prefix = after_generation(tok, prompt, prompt_text, generated, " four, or é", None, True)
    assert prefix is not None and prefix.ids == (*prompt, *generated)
    for rest in ("\nQuestion: and three?", " more", "more", "\n\n", "é ü 🎉", tok.eos_token + "\nnext"):
        ids = continued_prompt(tok, prefix, prefix.text + rest)
        assert ids is not None, (model, rest)
        assert ids[: len(prefix.ids)] == list(prefix.ids)
        assert tok.decode(ids[len(prompt):]) == " four, or é" + rest
    assert continued_prompt(tok, prefix, "Question: edited") is None
