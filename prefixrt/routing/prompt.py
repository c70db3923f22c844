"""RoutingKeys: an OpenAI request body -> the token ids a replica will see at the start of its prompt.

Routing is over token ids, not characters: chat messages are rendered with the model's chat template and
tokenized exactly as the engine does (lowering/messages.py engine_messages, then render_chat_template, then encode without
special tokens), so the template's header and turn markers are part of the key, and two conversations share a
key prefix exactly where their prompts share tokens. A Responses request is keyed as the chat it becomes
(instructions as the system message, input items as messages). A follow-up that names previous_response_id
is routed to the replica that stored that response, which the router tracks (the key then does not matter).

The key is approximate where the server adds text of its own (a tools note for templates that do not render
tools): the tools are left out, so every request with the same messages still gets the same key. A body the
router cannot read gets an empty key (the policy places it as a miss; the replica answers with its error).
A `cache_salt` is folded into a leading pseudo-token (a negative id no tokenizer emits), because replicas only
share cached prefixes within one salt; so is a `model` other than the base model's names (a LoRA adapter: replicas
share no K/V across adapters or with the base), before the salt's.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any

from prefixrt.hub.chat_templates import render_chat_template
from prefixrt.lowering.messages import engine_messages, responses_input

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


def salt_token(salt: str) -> int:
    """The pseudo-token a cache_salt contributes: negative, so it never equals a real id."""
    return -1 - int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=7).digest(), "big")


def model_token(model: str) -> int:
    """The pseudo-token a LoRA adapter's name contributes: negative (never a real id), hashed apart from salts."""
    return -1 - int.from_bytes(hashlib.blake2b(model.encode(), digest_size=7, person=b"prefixrt-lora").digest(),
                               "big")


class RoutingKeys:
    """Token ids of a request's prompt, from the model's tokenizer (thread-safe: one lock around it)."""

    def __init__(self, tokenizer, max_key_tokens: int = 1 << 16, base_models: tuple[str, ...] = ()):
        """base_models: the names the base model goes by (a request naming one, or none, is keyed by its prompt
        alone); any other `model` is a LoRA adapter's and leads its key with model_token."""
        self.tokenizer = tokenizer
        self.max_key_tokens = max_key_tokens  # a key past this many tokens is cut (routing needs the head)
        self.base_models = frozenset(base_models)
        self._lock = threading.Lock()

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        with self._lock:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def chat_ids(self, messages: list[dict], continue_final_message: bool = False) -> list[int]:
        """What the engine's chat_prompt_ids gives for these OpenAI messages (without tools)."""
        msgs = engine_messages(messages)
        with self._lock:
            text = render_chat_template(self.tokenizer, msgs, continue_final_message=continue_final_message)
        return self._encode(text, False)

    def completion_ids(self, prompt: Any) -> list[int]:
        """A completions prompt (text, token ids, or a batch of either: keyed by its first prompt)."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self._encode(prompt, True)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        return []

    def of(self, route: str, body: Any) -> list[int]:
        """The routing key of a request body on one of ROUTES; [] when the body cannot be read."""
        if not isinstance(body, dict):
            return []
        try:
            if route == "/v1/chat/completions":
                ids = self.chat_ids(body["messages"], bool(body.get("continue_final_message")))
            elif route == "/v1/completions":
                ids = self.completion_ids(body.get("prompt"))
            elif route == "/v1/responses":
                system = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
                ids = self.chat_ids(system + responses_input(body.get("input", [])))
            else:
                return []
        except Exception:  # malformed messages, a template that refuses them: the replica reports it
            return []
        ids = ids[: self.max_key_tokens]
        salt = body.get("cache_salt")
        if isinstance(salt, str) and salt:
            ids = [salt_token(salt), *ids]
        model = body.get("model")
        if isinstance(model, str) and model and model not in self.base_models:
            ids = [model_token(model), *ids]
        return ids
