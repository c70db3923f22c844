"""The output format a DSPy adapter asks for, as a constraint: so a DSPy program parses on the first call.

DSPy's adapters describe the reply they expect in the prompt and parse it afterwards; a small model often
misses the format, and DSPy then retries with another adapter (a second call) or fails. DSPy passes the LM
only messages (no signature), but its adapters spell out the output fields in fixed sentences, and that is
enough to rebuild the format as a grammar (llguidance Lark):

- ChatAdapter: the last user message ends with "Respond with the corresponding output fields, starting with
  the field `[[ ## a ## ]]`, then `[[ ## b ## ]]` (must be formatted as a valid Python int), and then ending
  with the marker for `[[ ## completed ## ]]`." The system message's field structure carries each field's
  note ("must be a single int value", "must be True or False", "must exactly match (no extra characters) one
  of: x; y", "must adhere to the JSON schema: {...}"). The reply becomes
  `[[ ## a ## ]]\\n<a>\\n\\n[[ ## b ## ]]\\n<b>\\n\\n[[ ## completed ## ]]`, headers forced, each value typed:
  text (non-empty, no blank line and no "[[" inside, so a paragraph break or a header moves on to the next
  field), an integer or number,
  True/False, one of the choices, or JSON under the field's schema (strict-mode rule applied).
- XMLAdapter: "Respond with the corresponding output fields wrapped in XML tags `<a>`, then `<b>`." ->
  `<a>\\n<text>\\n</a>\\n<b>\\n...</b>` (typed the same way where the structure block gives a note). DSPy parses
  the reply as XML, so a text value is character data: no `<` (never a tag, its own field's included: a model
  that wrote `<a>\\n<a-value>` left a reply DSPy could not parse, and DSPy called the LM again), `&` only in an
  entity reference.
- JSONAdapter sends its schema as `response_format` itself (the engine declares response-schema support),
  except when an output field is an open mapping (`dict[str, Any]`: ReAct's `next_tool_args`, Refine's
  feedback `advice`): then it sends `json_object`, any JSON object, and a small model writes keys of its own.
  "Respond with a JSON object in the following order of fields: `a`, then `b` (...)." and the field notes of
  its "Outputs will be a JSON object with the following fields." block give the object's schema instead
  (`json_adapter_schema`): those keys, in that order, each typed from its note (text, int, float, bool,
  Literal choices, the field's JSON schema), all required, no others. dspy.ReAct's step becomes one branch per
  tool it lists: `next_tool_name` that tool, `next_tool_args` under that tool's argument schema (`finish`: `{}`).

`output_format_constraint(messages)` returns {"grammar": ...} or {} when no adapter format is recognised
(plain prompts are left unconstrained); `json_adapter_schema(messages)` the JSONAdapter reply's schema or None.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from xml.etree import ElementTree as ET
from xml.sax.saxutils import escape as xml_escape

from prefixrt.constrained.spec import JSON_ITEM_SEPARATOR, JSON_KEY_SEPARATOR
from prefixrt.lowering.json_schema import strict_schema

_CHAT_REQUEST = re.compile(r"Respond with the corresponding output fields, starting with the field (.*?), and then "
                           r"ending with the marker for `\[\[ ## completed ## \]\]`\.", re.S)
_CHAT_FIELD = re.compile(r"`\[\[ ## (\w+) ## \]\]`")
_XML_REQUEST = re.compile(r"Respond with the corresponding output fields wrapped in XML tags ((?:`<\w+>`(?:, then )?)+)")
_XML_FIELD = re.compile(r"`<(\w+)>`")
_NOTE = "# note: the value you produce "
_JSON_REQUEST = re.compile(r"Respond with a JSON object in the following order of fields: (.*?)\.\s*$", re.S)
# dspy.ReAct lists its tools in the instructions, one a line, as `str(dspy.Tool)` writes them.
_REACT_TOOL = re.compile(r"^\s*\(\d+\) (\S+?)(?:, whose description is <desc>.*</desc>)?\. It takes arguments (\{.*\})\.\s*$",
                         re.M)

# A text value: starts with a visible character, has no blank line (a paragraph break ends the field) and no
# "[[" (a small model that starts writing a field header inside a value is steered to the real one).
_TEXT = r"/[^\s\[]([^\n\[]|\n[^\n\[]|\[[^\[\n])*/"
# XMLAdapter parses the reply as XML (ElementTree, expat): a text value is character data: no `<` (so never a tag,
# its own field's included: a model that wrote `<answer>\n<answer-value>` left a reply DSPy could not parse, and
# DSPy called the LM again), `&` only in one of XML's five named entity references (a numeric one may name a
# character XML forbids, `&#0;`), no character outside XML 1.0's Char production (C0 controls other than tab, LF
# and CR; U+FFFE, U+FFFF; a surrogate is no UTF-8 text at all), and never `]]>` (_XML_GUARD).
_XML_ENTITY = r"&(amp|lt|gt|quot|apos);"
_NOT_XML_CHAR = r"\x00-\x08\x0B\x0C\x0E-\x1F\x{FFFE}\x{FFFF}"
_XML_TEXT = (rf"/([^\s\[<&{_NOT_XML_CHAR}]|{_XML_ENTITY})([^\n\[<&{_NOT_XML_CHAR}]|{_XML_ENTITY}|"
             rf"\n[^\n\[<&{_NOT_XML_CHAR}]|\n{_XML_ENTITY}|\[[^\[\n<&{_NOT_XML_CHAR}]|\[{_XML_ENTITY})*/")
_XML_GUARD = r" & ~/(?s:.*\]\]>.*)/"  # intersected with a text lexeme: no `]]>` anywhere in it
# A JSON string inside XML character data (a nested field's JSON value): JSON escapes control characters, but
# `<`, `&` and U+FFFE / U+FFFF would be written as they are.
_XML_SAFE_STRING = "^[^<&\uFFFE\uFFFF]*$"
_INT = r"/-?[0-9]+/"
_NUMBER = r"/-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?/"


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _notes(system: str) -> dict[str, str]:
    """field name -> the note DSPy's field structure gives its value ("" for plain text)."""
    notes = {}
    for m in re.finditer(r"\[\[ ## (\w+) ## \]\]\n\{\1\}([^\n]*)", system):
        rest = m.group(2)
        notes[m.group(1)] = rest.split(_NOTE, 1)[1].strip() if _NOTE in rest else ""
    for m in re.finditer(r"<(\w+)>\n\{\1\}([^\n]*)", system):
        rest = m.group(2)
        notes.setdefault(m.group(1), rest.split(_NOTE, 1)[1].strip() if _NOTE in rest else "")
    return notes


def _react_tools(system: str) -> dict[str, dict]:
    """dspy.ReAct's tools from its instructions: name -> the JSON schema of its arguments (an object of the
    tool's `args`, required unless they have a default, as `dspy.Tool` describes them)."""
    tools = {}
    for m in _REACT_TOOL.finditer(system):
        try:
            args = ast.literal_eval(m.group(2))  # a Python dict repr (str(dict)), not JSON
        except (ValueError, SyntaxError):
            continue
        if isinstance(args, dict) and all(isinstance(v, dict) for v in args.values()):
            tools[m.group(1)] = {"type": "object", "properties": args,
                                 "required": [k for k, v in args.items() if "default" not in v]}
    return tools


@dataclass(frozen=True)
class _Form:
    """How an adapter's reply spells a value: `text` the regex of a text value, `guard` what every text lexeme is
    also intersected with (llguidance's `&` / `~`), `json_schema` the schema a JSON value is held to (the field's,
    made safe for where it stands), `literal` a choice's spelling."""

    text: str
    guard: str = ""
    json_schema: Callable[[dict], dict] = lambda schema: schema
    literal: Callable[[str], str] = lambda value: value


def xml_safe_schema(schema: Any) -> Any:
    """schema with every free string (no enum, const, pattern or format of its own) held to characters that XML
    character data takes as they are: JSON writes `<`, `&`, U+FFFE and U+FFFF unescaped."""
    if isinstance(schema, list):
        return [xml_safe_schema(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in ("enum", "const", "required") else xml_safe_schema(v)) for k, v in schema.items()}
    if out.get("type") == "string" and not out.keys() & {"enum", "const", "pattern", "format"}:
        out["pattern"] = _XML_SAFE_STRING
    return out


_CHAT = _Form(_TEXT)
_XML = _Form(_XML_TEXT, _XML_GUARD, xml_safe_schema, lambda value: xml_escape(value))


def _json_rule(rule: str, schema: dict, suffix: str, rules: list[str], form: _Form = _CHAT) -> str:
    schema = {**form.json_schema(strict_schema(schema)), "x-guidance": {
        "whitespace_flexible": False, "item_separator": JSON_ITEM_SEPARATOR, "key_separator": JSON_KEY_SEPARATOR}}
    rules.append(f"{rule}: %json {json.dumps(schema, ensure_ascii=False)} {_lit(suffix)}")
    return rule


def _tool_call_rule(options: list[str], tools: dict[str, dict], between: str, suffix: str,
                    rules: list[str], form: _Form = _CHAT) -> str:
    """ReAct's `next_tool_name` then `next_tool_args` as one rule: each tool name followed by arguments under
    that tool's schema (an open object was closed `{}` at once by a small model, and the call failed)."""
    alts = []
    for k, name in enumerate(options):
        args = _json_rule(f"args_{k}", tools[name], suffix, rules, form)
        alts.append(f"{_lit(form.literal(name) + between)} {args}")
    rules.append("v_next_tool_name: " + " | ".join(alts))
    return "v_next_tool_name"


def _value_rule(name: str, note: str, suffix: str, rules: list[str], text_cap: int | None = None,
                form: _Form = _CHAT) -> str:
    """A rule for one field's value followed by `suffix`; appended to `rules`, its name returned. text_cap: the
    most tokens a text value may take (then its suffix is forced), or None. form: how the reply spells values."""
    rule = f"v_{name}"
    if note.startswith(_JSON_NOTE):
        try:
            schema = json.loads(note[len(_JSON_NOTE):])
        except ValueError:
            schema = None
        if isinstance(schema, dict):
            return _json_rule(rule, schema, suffix, rules, form)
    guard = ""
    if note == "must be True or False":
        body = "/True|False/"
    elif note in ("must be a single int value",):
        body = _INT
    elif note in ("must be a single float value",):
        body = _NUMBER
    elif note.startswith("must exactly match (no extra characters) one of: ") or note.startswith("must be one of: "):
        options = note.split(": ", 1)[1].split("; ")
        alts = " | ".join(_lit(form.literal(o)) for o in options)
        rules.append(f"{rule}: ({alts}) {_lit(suffix)}")
        return rule
    else:
        body, guard = form.text, form.guard
        if text_cap is not None and suffix.startswith("\n") and len(suffix) > 1:
            # llguidance ends a capped suffix-lexeme without its suffix, so the suffix is written out after a
            # greedy text lexeme. Its lexer looks one byte ahead and never backs up: the text keeps an optional
            # final newline and no line of it begins as the suffix's next line does, so the text can end at
            # that newline (before the cap) and the suffix's rest follows.
            nxt = "" if suffix[1] == "\n" else re.escape(suffix[1]).replace("/", "\\/")
            capped = body.replace(r"|\n[^\n\[", rf"|\n[^\n\[{nxt}").replace(")*/", r")*\n?/")
            rules += [f"{rule}: {rule}_text {_lit(suffix[1:])}",
                      f"{rule}_text[max_tokens={text_cap}]: {capped}{guard}"]
            return rule
    rules.append(f"{rule}[suffix={_lit(suffix)}]: {body}{guard}")
    return rule


# Tokens a field header and the separators around it take (`\n\n[[ ## name ## ]]\n`: 8 to 12 in common vocabularies).
_HEADER_TOKENS = 12


def text_cap(fields: list[str], max_tokens: int | None) -> int | None:
    """The most tokens each text value may take so that every field and the end marker fit in `max_tokens`:
    an equal share of what the headers leave (at least 8). None without a budget."""
    if not max_tokens:
        return None
    return max(8, (max_tokens - _HEADER_TOKENS * (len(fields) + 1)) // max(1, len(fields)))


def _options(note: str) -> list[str] | None:
    for lead in ("must exactly match (no extra characters) one of: ", "must be one of: "):
        if note.startswith(lead):
            return note[len(lead):].split("; ")
    return None


def _fields_grammar(fields: list[str], notes: dict[str, str], tools: dict[str, dict], first: str, after,
                    max_tokens: int | None = None, form: _Form = _CHAT) -> str:
    """`first` then each field's value followed by `after(k)` (the text between field k and the next, or the
    end). dspy.ReAct's next_tool_name + next_tool_args pair becomes one rule when every option is a known tool.
    form: how the reply spells values."""
    rules: list[str] = []
    seq = []
    k = 0
    while k < len(fields):
        name = fields[k]
        options = _options(notes.get(name, ""))
        if (name == "next_tool_name" and fields[k + 1:k + 2] == ["next_tool_args"] and options
                and all(o in tools for o in options)):
            seq.append(_tool_call_rule(options, tools, after(k), after(k + 1), rules, form))
            k += 2
            continue
        seq.append(_value_rule(name, notes.get(name, ""), after(k), rules, text_cap(fields, max_tokens), form))
        k += 1
    return "\n".join([f"start: {_lit(first)} " + " ".join(seq), *rules])


def chat_adapter_grammar(fields: list[str], notes: dict[str, str], tools: dict[str, dict] | None = None,
                         max_tokens: int | None = None) -> str:
    def after(k: int) -> str:
        return f"\n\n[[ ## {fields[k + 1]} ## ]]\n" if k + 1 < len(fields) else "\n\n[[ ## completed ## ]]"

    return _fields_grammar(fields, notes, tools or {}, f"[[ ## {fields[0]} ## ]]\n", after, max_tokens)


def xml_adapter_grammar(fields: list[str], notes: dict[str, str], tools: dict[str, dict] | None = None,
                        max_tokens: int | None = None) -> str:
    """notes: as _notes reads them, with a nested field's (nested_field_schemas) as a JSON-schema note: its value
    is JSON text, which XMLAdapter reads as the field's value when the element holds no child elements."""
    def after(k: int) -> str:
        return f"\n</{fields[k]}>" + (f"\n<{fields[k + 1]}>\n" if k + 1 < len(fields) else "")

    return _fields_grammar(fields, notes, tools or {}, f"<{fields[0]}>\n", after, max_tokens, _XML)


def output_format_constraint(messages: list[dict], max_tokens: int | None = None,
                             nested_schemas: dict[str, dict] | None = None) -> dict:
    """{"grammar": ...} for the reply format a DSPy adapter asked for in `messages`, or {}. max_tokens: the
    reply's budget; each text value is then capped (`text_cap`) so that every field is written within it (a
    small model otherwise writes the first text field until max_tokens, and the reply does not parse).
    nested_schemas: for XMLAdapter, the JSON schemas of its nested fields where the caller knows them (the
    signature's types); otherwise they are read from the prompt (`nested_field_schemas`)."""
    users = [m for m in messages if m.get("role") == "user"]
    if not users:
        return {}
    last = users[-1].get("content") or ""
    system = "\n".join(m.get("content") or "" for m in messages if m.get("role") == "system")
    m = _CHAT_REQUEST.search(last)
    if m:
        fields = _CHAT_FIELD.findall(m.group(1))
        if fields:
            notes = {k: _capped_note(v, text_cap(fields, max_tokens)) for k, v in _notes(system).items()}
            return {"grammar": chat_adapter_grammar(fields, notes, _react_tools(system), max_tokens)}
    m = _XML_REQUEST.search(last)
    if m:
        fields = _XML_FIELD.findall(m.group(1))
        if fields:
            notes = _notes(system)
            for name, schema in nested_field_schemas(last, system, nested_schemas).items():
                if name in fields:
                    notes[name] = _JSON_NOTE + json.dumps(schema, ensure_ascii=False)
            notes = {k: _capped_note(v, text_cap(fields, max_tokens)) for k, v in notes.items()}
            return {"grammar": xml_adapter_grammar(fields, notes, _react_tools(system), max_tokens)}
    return {}


_JSON_NOTE = "must adhere to the JSON schema: "
_NESTED_REQUEST = re.compile(r"Use this nested XML structure: (.*)\Z", re.S)
_FIELD_LABEL = re.compile(r"^\d+\. `(\w+)` \((.*)\):", re.M)
_LIST_OF = {"list[str]": "string", "list[int]": "integer", "list[float]": "number", "list[bool]": "boolean"}


def nested_skeletons(request: str) -> dict[str, str]:
    """XMLAdapter's nested-XML skeletons in its request (`Use this nested XML structure: <l><item>...</item></l>
    ...`): field name -> the skeleton as DSPy's `_xml_schema` writes it. Empty when the request has none."""
    m = _NESTED_REQUEST.search(request)
    if not m:
        return {}
    try:
        root = ET.fromstring(f"<r>{m.group(1).strip()}</r>")
    except ET.ParseError:
        return {}
    out = {}
    for child in root:
        child.tail = None
        out[child.tag] = ET.tostring(child, encoding="unicode")
    return out


def nested_field_schemas(request: str, system: str, known: dict[str, dict] | None = None) -> dict[str, dict]:
    """The JSON schema of each field XMLAdapter asks for as nested XML: from `known` (the signature's types, by
    the caller) where given, else from the skeleton and the field's type label in the system message
    (`list[int]`, `dict[...]`): lists of `<item>`, objects of their child tags, and text leaves (the skeleton
    has no leaf types)."""
    labels = dict(_FIELD_LABEL.findall(system))
    out = {}
    for name, skeleton in nested_skeletons(request).items():
        if known and name in known:
            out[name] = known[name]
            continue
        label = labels.get(name, "")
        if label in _LIST_OF:
            out[name] = {"type": "array", "items": {"type": _LIST_OF[label]}}
        elif label.startswith("dict"):
            out[name] = {"type": "object"}
        else:
            out[name] = _skeleton_schema(ET.fromstring(skeleton))
    return out


def _skeleton_schema(element: ET.Element) -> dict:
    children = list(element)
    if not children:
        return {"type": "string"}
    if len(children) == 1 and children[0].tag == "item":
        return {"type": "array", "items": _skeleton_schema(children[0])}
    return {"type": "object", "properties": {c.tag: _skeleton_schema(c) for c in children},
            "required": [c.tag for c in children], "additionalProperties": False}


def _capped_note(note: str, cap: int | None) -> str:
    """A JSON-schema note with its free strings capped at `cap` characters (`_capped`, through the tree), so a
    nested value closes within the reply's budget; other notes as they are."""
    if cap is None or not note.startswith(_JSON_NOTE):
        return note
    try:
        schema = json.loads(note[len(_JSON_NOTE):])
    except ValueError:
        return note
    return _JSON_NOTE + json.dumps(_capped_tree(schema, cap), ensure_ascii=False)


def _capped_tree(schema: Any, cap: int) -> Any:
    if isinstance(schema, list):
        return [_capped_tree(v, cap) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in ("enum", "const", "required") else _capped_tree(v, cap)) for k, v in schema.items()}
    return _capped(out, cap)


def _json_notes(system: str) -> dict[str, str]:
    """JSONAdapter's field structure: one `"name": "{name}        # note: ..."` line per output field."""
    notes = {}
    for line in system.splitlines():
        line = line.strip().rstrip(",")
        if not line.startswith('"'):
            continue
        try:
            pair = json.loads("{" + line + "}")
        except ValueError:
            continue
        for name, value in pair.items():
            if isinstance(value, str) and value.startswith("{" + name + "}"):
                notes[name] = value.split(_NOTE, 1)[1].strip() if _NOTE in value else ""
    return notes


def _note_schema(note: str) -> dict:
    if note.startswith("must adhere to the JSON schema: "):
        try:
            schema = json.loads(note[len("must adhere to the JSON schema: "):])
        except ValueError:
            return {}
        return schema if isinstance(schema, dict) else {}
    if note == "must be True or False":
        return {"type": "boolean"}
    if note == "must be a single int value":
        return {"type": "integer"}
    if note == "must be a single float value":
        return {"type": "number"}
    options = _options(note)
    if options is not None:
        return {"enum": options}
    return {"type": "string"} if note == "" else {}


def json_adapter_schema(messages: list[dict], max_tokens: int | None = None) -> dict | None:
    """The JSON schema of the reply JSONAdapter asked for in `messages` (its output fields, in order, typed from
    their notes, all required, no others), or None when the messages are not JSONAdapter's. max_tokens: the
    reply's budget; each plain string (a text field, a ReAct tool's string argument) then has a maxLength of
    `text_cap` characters (a character takes at most one token), so the object closes within the budget (a small
    model otherwise writes its first text field until max_tokens, and the reply does not parse)."""
    users = [m for m in messages if m.get("role") == "user"]
    if not users:
        return None
    m = _JSON_REQUEST.search(users[-1].get("content") or "")
    if not m:
        return None
    fields = [f.group(1) for f in re.finditer(r"(?:^|, then )`(\w+)`", m.group(1))]
    if not fields:
        return None
    system = "\n".join(msg.get("content") or "" for msg in messages if msg.get("role") == "system")
    notes = _json_notes(system)
    cap = text_cap(fields, max_tokens)
    properties = {f: _capped(_note_schema(notes.get(f, "")), cap) for f in fields}
    branches = _react_branches(fields, properties, _react_tools(system), cap)
    if branches:
        return {"anyOf": branches}
    return {"type": "object", "properties": properties, "required": fields, "additionalProperties": False}


def cap_json_adapter_strings(schema: dict, messages: list[dict], max_tokens: int | None) -> dict:
    """JSONAdapter's response_format schema with every free string capped at `text_cap` characters of the reply's
    budget (as json_adapter_schema caps its own), when `messages` are JSONAdapter's; else `schema` unchanged."""
    users = [m for m in messages if m.get("role") == "user"]
    m = _JSON_REQUEST.search(users[-1].get("content") or "") if users else None
    fields = [f.group(1) for f in re.finditer(r"(?:^|, then )`(\w+)`", m.group(1))] if m else []
    cap = text_cap(fields, max_tokens) if fields else None
    return schema if cap is None else _capped_tree(schema, cap)


def _capped(schema: dict, cap: int | None) -> dict:
    """schema with maxLength `cap` when it is a plain string (no length, enum, const, pattern or format of its own)."""
    if cap is None or schema.get("type") != "string" or schema.keys() & {"maxLength", "enum", "const", "pattern",
                                                                          "format"}:
        return schema
    return {**schema, "maxLength": cap}


def _react_branches(fields: list[str], properties: dict, tools: dict[str, dict],
                    cap: int | None = None) -> list[dict] | None:
    """dspy.ReAct's step under JSONAdapter: one object schema per tool it lists, `next_tool_name` that tool and
    `next_tool_args` its arguments (closed, every argument written; `finish` takes `{}`), so a step's call
    always validates. None unless the fields hold that pair and every tool choice is a known tool."""
    if "next_tool_name" not in fields or "next_tool_args" not in fields:
        return None
    names = properties["next_tool_name"].get("enum")
    if not names or not all(n in tools for n in names):
        return None
    def args(name: str) -> dict:
        schema = strict_schema(tools[name])
        props = {k: _capped(v, cap) for k, v in (schema.get("properties") or {}).items()}
        return {**schema, "properties": props} if props else schema

    return [{"type": "object", "properties": {**properties, "next_tool_name": {"const": name},
                                              "next_tool_args": args(name)},
             "required": fields, "additionalProperties": False} for name in names]
