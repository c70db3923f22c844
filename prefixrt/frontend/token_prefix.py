"""Token continuity: a program's next prompt starts with the exact token ids of its previous prompt and of what
the model generated, instead of the whole text encoded again.

Why: a program's state is text, and a prompt used to be that text encoded from scratch. Generated ids, decoded
and encoded again, can come back as other ids (random answers almost always do, real ones sometimes); the next
prompt then left the cache's path inside the answer and recomputed everything after it, so the hit rate of a
multi-turn program depended on what the model wrote and on the tokenizer.

Exactness: ids are reused only where they spell the text, checked by decoding across each boundary
(`_spells`). Generated ids are the engine's, less the stop token or the tokens of a stop string cut from the text;
they are kept only when, after the prompt, they decode to exactly the text the state appended. Text appended
after the remembered prefix is encoded alone, without special tokens, and kept only when it decodes to exactly
itself after the prefix's last ids: a tokenizer that prepends a space to a string encoded alone (sentencepiece's
dummy prefix) fails that check, and such a prompt is encoded whole, as before. The prompt is then a valid
spelling of its text but not always the one encoding the whole text would give (a word split across the
boundary stays split): it is the model's own, which is what the cache holds.
"""

from __future__ import annotations

from dataclasses import dataclass

# Ids before a boundary that are decoded with the ids after it: enough for a multi-byte character or a merge of
# word pieces to show up as a difference, few enough that the check costs little against the prompt.
_CONTEXT_IDS = 8


@dataclass(frozen=True)
class TokenPrefix:
    """The text a program state's prompt begins with and the token ids the engine has for it: the previous
    call's prompt ids followed by the ids it generated. Carried by a state from one gen to the next (and into
    its forks), so the next prompt reuses those exact ids and hence their cached KV."""

    text: str
    ids: tuple[int, ...]


def continued_prompt(tokenizer, prefix: TokenPrefix, text: str) -> list[int] | None:
    """The token ids of prompt `text` as prefix.ids + the rest of text encoded alone, when text starts with
    prefix.text and that rest's ids spell it exactly after the prefix; None otherwise (the caller encodes the
    whole text). The caller holds the tokenizer's lock."""
    if not text.startswith(prefix.text):
        return None
    rest = text[len(prefix.text):]
    if not rest:
        return list(prefix.ids)
    rest_ids = tokenizer.encode(rest, add_special_tokens=False)
    if not _spells(tokenizer, prefix.ids[-_CONTEXT_IDS:], rest_ids, rest, skip_special_tokens=False,
                   clean_up_tokenization_spaces=False):
        return None
    return [*prefix.ids, *rest_ids]


def after_generation(tokenizer, prompt_ids: list[int], prompt_text: str, token_ids: list[int], text: str,
                     matched_stop, skip_special_tokens: bool) -> TokenPrefix | None:
    """The TokenPrefix of prompt_text + text (a gen's result appended to its prompt): prompt_ids + the prefix of
    the engine's token_ids that decodes to exactly `text` after the prompt, as the engine decoded it
    (skip_special_tokens). A stop token id (matched_stop an int) is dropped, as the engine leaves it out of the
    text; after a stop string, the tokens it was cut from are dropped. None when no prefix of token_ids spells
    text (e.g. a stop string that ends inside a token). The caller holds the tokenizer's lock."""
    ids = list(token_ids)
    if isinstance(matched_stop, int) and ids and ids[-1] == matched_stop:
        ids.pop()
    head = prompt_ids[-_CONTEXT_IDS:]
    decode = dict(skip_special_tokens=skip_special_tokens)
    if isinstance(matched_stop, str):
        base = len(tokenizer.decode(head, **decode))
        while ids and len(tokenizer.decode([*head, *ids], **decode)) - base > len(text):
            ids.pop()
    if not _spells(tokenizer, head, ids, text, **decode):
        return None
    return TokenPrefix(prompt_text + text, (*prompt_ids, *ids))


def _spells(tokenizer, head, ids: list[int], text: str, **decode) -> bool:
    """ids, decoded after head, add exactly `text` to head's decoded text."""
    before = tokenizer.decode(list(head), **decode)
    return tokenizer.decode([*head, *ids], **decode) == before + text
