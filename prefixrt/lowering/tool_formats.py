"""Model families' own tool-call syntax: which one a chat template uses, and reading calls back from a reply.

  hermes    Qwen 2.5/3, Hermes, and other templates that write `<tool_call>{"name", "arguments"}</tool_call>`
            (one block per call).
  llama3    Llama 3.1/3.2 JSON tool calling: `{"name": ..., "parameters": {...}}` (the key the template asks
            for), optionally after `<|python_tag|>`; several calls separated by `;` or a newline.
  mistral   Mistral: `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}` (v3 tokenizers), or
            `[TOOL_CALLS]name[ARGS]{...}` per call (v11+). `[TOOL_CALLS]` is a special token, gone from text
            decoded with skip_special_tokens, so a reply that opens with the array alone reads the same.
  pythonic  Gemma 3 (its documented function-calling prompt) and Llama 3.2's pythonic form: Python calls,
            `[get_weather(city="Paris"), ...]` or one per line, optionally inside a ```tool_code block.
            Arguments must be literals (read with ast.literal_eval, never evaluated).

`detect(template)` names the family of a chat template that renders `tools` itself (None when it does not:
the tools are then described in a system message). `parse(family, text, names)` returns the calls, each a
(name, arguments) pair, or None when the reply is not calls of declared tools in that syntax (plain text,
or a call cut short). Pure text functions: nothing here knows tokens, engines or HTTP.
"""

from __future__ import annotations

import ast
import json
import re

FAMILIES = ("hermes", "llama3", "mistral", "pythonic")

Call = tuple[str, dict]


def detect(template: str | None) -> str | None:
    """The tool-call family of a chat template that renders tools, or None."""
    if not isinstance(template, str) or "tools" not in template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template or "[AVAILABLE_TOOLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and '"parameters"' in template):
        return "llama3"
    if "tool_code" in template or re.search(r"\[func_name\d?\(", template):
        return "pythonic"
    return None


def _json_objects(s: str, i: int, seps: str) -> tuple[list, int] | None:
    """JSON values from s[i:], separated by whitespace or one of `seps`; (values, end) or None."""
    decoder = json.JSONDecoder()
    out = []
    while True:
        while i < len(s) and (s[i].isspace() or (out and s[i] in seps)):
            i += 1
        if i == len(s) or s[i] not in "{[":
            return (out, i) if out else None
        try:
            value, i = decoder.raw_decode(s, i)
        except ValueError:
            return None
        out.append(value)


def _call(obj, names: set[str], keys: tuple[str, ...]) -> Call | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = next((obj[k] for k in keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return (obj["name"], args) if isinstance(args, dict) else None


def _all(calls: list) -> list[Call] | None:
    return calls if calls and all(c is not None for c in calls) else None


def parse_hermes(text: str, names: set[str]) -> list[Call] | None:
    calls, i = [], 0
    blocks = re.compile(r"\s*<tool_call>\s*(.*?)\s*</tool_call>", re.S)
    while i < len(text.rstrip()):
        m = blocks.match(text, i)
        if m is None:
            return None
        try:
            calls.append(_call(json.loads(m.group(1)), names, ("arguments", "parameters")))
        except ValueError:
            return None
        i = m.end()
    return _all(calls)


def parse_llama3(text: str, names: set[str]) -> list[Call] | None:
    s = text.strip()
    if s.startswith("<|python_tag|>"):
        s = s[len("<|python_tag|>"):]
    got = _json_objects(s, 0, ";")
    if got is None or s[got[1]:].strip():
        return None
    return _all([_call(o, names, ("parameters", "arguments")) for o in got[0]])


def parse_mistral(text: str, names: set[str]) -> list[Call] | None:
    s = text.strip()
    if s.startswith("[TOOL_CALLS]"):
        s = s[len("[TOOL_CALLS]"):].lstrip()
        if s and s[0] not in "[{":  # v11+: name[ARGS]{...}, repeated (each after its own [TOOL_CALLS])
            calls = []
            for part in s.split("[TOOL_CALLS]"):
                name, sep, args = part.partition("[ARGS]")
                got = _json_objects(args, 0, "") if sep else None
                if got is None or len(got[0]) != 1 or args[got[1]:].strip():
                    return None
                calls.append(_call({"name": name.strip(), "arguments": got[0][0]}, names, ("arguments",)))
            return _all(calls)
    got = _json_objects(s, 0, ",")
    if got is None or s[got[1]:].strip():
        return None
    objs = [o for v in got[0] for o in (v if isinstance(v, list) else [v])]
    return _all([_call(o, names, ("arguments", "parameters")) for o in objs])


def _literal(node: ast.AST):
    return ast.literal_eval(node)


def parse_pythonic(text: str, names: set[str]) -> list[Call] | None:
    s = text.strip()
    fence = re.fullmatch(r"```(?:tool_code|python)?\s*\n(.*?)\n?```", s, re.S)
    if fence is not None:
        s = fence.group(1).strip()
    if s.startswith("print(") and s.endswith(")"):  # Gemma's examples wrap the call in print(...)
        s = s[len("print("):-1]
    try:
        tree = ast.parse(s, mode="exec")
    except SyntaxError:
        return None
    nodes: list[ast.AST] = []
    for stmt in tree.body:
        if not isinstance(stmt, ast.Expr):
            return None
        value = stmt.value
        nodes.extend(value.elts if isinstance(value, ast.List) else [value])
    calls = []
    for node in nodes:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                and node.func.id in names and all(k.arg is not None for k in node.keywords)):
            return None
        try:
            calls.append((node.func.id, {k.arg: _literal(k.value) for k in node.keywords}))
        except (ValueError, TypeError, SyntaxError):
            return None
    return _all(calls)


_PARSERS = {"hermes": parse_hermes, "llama3": parse_llama3, "mistral": parse_mistral, "pythonic": parse_pythonic}


def parse(family: str, text: str, names: set[str]) -> list[Call] | None:
    """The calls written in `family`'s syntax (FAMILIES), or None."""
    return _PARSERS[family](text, names)


def leads(family: str) -> tuple[str, ...]:
    """What a reply in `family`'s syntax may begin with (after whitespace) when it is a call."""
    return {"hermes": ("<tool_call>", "{"), "llama3": ("<|python_tag|>", "{"),
            "mistral": ("[TOOL_CALLS]", "[", "{"), "pythonic": ("```", "[", "print(")}[family]


def may_be_call(family: str, text: str, names: set[str]) -> bool:
    """Whether a reply that begins with `text` may still be a call in `family`'s syntax (False: it is prose)."""
    head = text.lstrip()
    if not head:
        return True
    starts = leads(family) + (tuple(f"{n}(" for n in names) if family == "pythonic" else ())
    return any(head.startswith(s) or s.startswith(head) for s in starts)
