"""Chat templates: the Jinja templates the registry supplies for models whose checkpoint carries none, and
`render_chat_template`, the one function that applies a tokenizer's template (EngineAPI, hence the server
and the in-process engine, and the frontend's TemplateFormat all render through it).

Each renders `messages` (list of {"role", "content"}; content a string or a list of {"type": "text",
"text"} parts) and honours `add_generation_prompt`. Rendered text already starts with the BOS token where
the model expects one: tokenize it with `add_special_tokens=False` (as `apply_chat_template` does).
"""

from __future__ import annotations

import json
from pathlib import Path

# Gemma's turn format, as in Gemma 3's official template: roles `user` and `model`, a system message is
# folded into the first user turn (separated by a blank line), content is trimmed. Two deliberate
# differences, both so that programs which the official template rejects still render sensibly:
# consecutive turns of one role are rendered as they come instead of raising, and a system message that
# is not first (or is alone) becomes a user turn, as does a `tool` message. Images are refused.
GEMMA_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if messages and messages[0]['role'] == 'system' and messages | length > 1 -%}"
    "{%- set first_user_prefix = (messages[0]['content'] if messages[0]['content'] is string"
    " else messages[0]['content'] | map(attribute='text') | join('')) + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else 'user' -%}"
    "{{- '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] | trim -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}"
    "{{- part['text'] | trim -}}"
    "{%- else -%}"
    "{{- raise_exception('gemma-3-270m is text-only; got a content part of type ' + part['type']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<end_of_turn>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<start_of_turn>model\\n' -}}"
    "{%- endif -%}"
)

# Llama 3's header format (without the tool-calling and date preamble of the 3.1+ instruct template).
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- set content = message['content'] if message['content'] is string"
    " else message['content'] | map(attribute='text') | join('') -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + content | trim"
    " + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{%- endif -%}"
)

# ChatML, as Qwen uses it (no BOS token).
CHATML_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set content = message['content'] if message['content'] is string"
    " else message['content'] | map(attribute='text') | join('') -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)


# SmolLM2-Instruct's ChatML, as its GGUF ships it (a default system turn when the conversation has none, no
# BOS token), extended to accept content given as a list of {"type": "text"} parts.
SMOLLM2_CHAT_TEMPLATE = (
    "{%- if messages and messages[0]['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- set content = message['content'] if message['content'] is string"
    " else message['content'] | map(attribute='text') | join('') -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)


def render_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                         continue_final_message: bool = False, tools: list[dict] | None = None) -> str:
    """The text tokenizer's chat template makes of messages (tokenize it with add_special_tokens=False).

    continue_final_message: the last message must be the assistant's; the earlier ones are rendered with the
    generation prompt and its content follows verbatim, left open for the model to continue (as vLLM and
    SGLang accept it). tools: OpenAI-style tool definitions for templates that render them
    (`apply_chat_template(tools=...)`). The caller holds the tokenizer's lock (fast tokenizers are not
    thread-safe); template errors propagate as they are.
    """
    kwargs = {"tools": tools} if tools else {}
    if continue_final_message:
        if not messages or messages[-1].get("role") != "assistant":
            raise ValueError("continue_final_message needs a final assistant message")
        head = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True, **kwargs)
        return head + messages[-1]["content"]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **kwargs)


def store_chat_template_in_tokenizer_config(folder: Path, chat_template: str | None) -> None:
    """Make `folder`'s tokenizer_config.json the one place that holds the chat template.

    Recent transformers save templates to chat_template.jinja; older readers and other tools look in
    tokenizer_config.json (`chat_template`). Rewrites tokenizer_config.json and removes the .jinja file.
    """
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.exists():
        jinja_file.unlink()
    config_file = folder / "tokenizer_config.json"
    tokenizer_config = json.loads(config_file.read_text(encoding="utf-8"))
    if chat_template is None:
        tokenizer_config.pop("chat_template", None)
    else:
        tokenizer_config["chat_template"] = chat_template
    config_file.write_text(
        json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
