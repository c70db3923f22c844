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

The budget (ChatAdapter, XMLAdapter). Given the request's max_tokens, the longest reply the grammar allows fits
it, counted in tokens, so a reply is never cut before its last field (a small model otherwise writes one value
until max_tokens, and DSPy calls the LM again). Every part of the reply is bounded:
- the format's own text (headers, tags, what lies between the fields): at most its length in bytes (a token
  holds at least one byte), or, with the model's tokenizer at hand (`count_tokens`, the in-process LM), its
  tokens and _BOUNDARY_TOKENS for the merges at its ends, where that is less;
- a bounded value (True/False, a choice, an int of at most 19 digits, a float of at most 15 + 15 digits and a
  3-digit exponent): its longest spelling in bytes, as a model may spell it a byte a token;
- the free values share the rest (`value_caps`): each gets the same room beyond its shortest spelling (a text
  value: 1 token; a JSON value: the longest shortest-spelling of the reply's JSON values, `_shortest_json`, as
  they share one cap). A text value is one lexeme capped with llguidance's `max_tokens`, which ends it after that
  many tokens (XMLAdapter's entity references are then kept where a cut cannot split them: `_xml_capped`). A
  JSON value's schema carries `x-max-tokens`, and the engine's BudgetMatcher (prefixrt/constrained/budget.py)
  closes each document within it, strings, arrays and numbers alike, as a document the schema accepts.
A tight max_tokens leaves the free values little room, down to their shortest spelling; where not even the
shortest reply fits, output_format_constraint raises InvalidRequest with the budget it takes. JSONAdapter's reply is one JSON document, which the
BudgetMatcher closes within max_tokens; `text_cap` only keeps its first string from taking it all.
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

from prefixrt.constrained.budget import MAX_TOKENS_KEY
from prefixrt.constrained.spec import JSON_ITEM_SEPARATOR, JSON_KEY_SEPARATOR
from prefixrt.errors import InvalidRequest
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
# Numbers have a bounded spelling (19 digits hold any int64; 15 + 15 digits and a 3-digit exponent any float a model
# means), so their share of the reply is their longest spelling in bytes (`_bounded`).
_INT = r"/-?[0-9]{1,19}/"
_NUMBER = r"/-?[0-9]{1,15}(\.[0-9]{1,15})?([eE][-+]?[0-9]{1,3})?/"


@dataclass(frozen=True)
class _Scalar:
    """How DSPy's note of a scalar type is written: the value's regex, its longest spelling in bytes, its schema."""

    regex: str
    most_bytes: int
    schema: dict


_SCALARS = {
    "must be True or False": _Scalar("/True|False/", len("False"), {"type": "boolean"}),
    "must be a single int value": _Scalar(_INT, 1 + 19, {"type": "integer"}),  # sign, digits
    "must be a single float value": _Scalar(_NUMBER, 1 + 15 + 1 + 15 + 2 + 3, {"type": "number"}),  # sign, ".", "e-"
}


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


def _chat_capped(nxt: str, cap: int) -> str:
    """ChatAdapter's text value as a lexeme capped at `cap` tokens (`_value_rule`): it keeps an optional final
    newline, and no line of it begins with `nxt` (the suffix's next character)."""
    return _TEXT.replace(r"|\n[^\n\[", rf"|\n[^\n\[{nxt}").replace(")*/", r")*\n?/")


def _xml_capped(nxt: str, cap: int) -> str:
    """XMLAdapter's text value as a lexeme capped at `cap` tokens. llguidance ends a capped lexeme after its cap-th
    token wherever it is, also inside an entity reference (`&am`), which XML refuses; so a reference only stands
    where it ends within the value's first cap - 1 bytes, all of them ASCII (a token holds at least one byte, so
    such a reference is complete before the cut): `&` later on is refused, the rest of the text is as
    `_XML_TEXT`. As `_chat_capped`, an optional final newline and no line beginning with `nxt`."""
    n, e = _NOT_XML_CHAR, _XML_ENTITY
    unit = rf"[^\n\[<&{n}]|\n[^\n\[<&{n}{nxt}]|\[[^\[\n<&{n}]"
    with_refs = rf"/([^\s\[<&{n}]|{e})({unit}|{e}|\n{e}|\[{e})*/ & /[\x00-\x7F]{{1,{max(1, cap - 1)}}}/"
    return rf"(({with_refs}) /({unit})*\n?/ | /[^\s\[<&{n}]({unit})*\n?/){_XML_GUARD}"


@dataclass(frozen=True)
class _Form:
    """How an adapter's reply spells a value: `text` the regex of a text value, `guard` what every text lexeme is
    also intersected with (llguidance's `&` / `~`), `capped(nxt, cap)` a text value capped at `cap` tokens (guard
    included), `json_schema` the schema a JSON value is held to (the field's, made safe for where it stands),
    `literal` a choice's spelling."""

    text: str
    capped: Callable[[str, int], str]
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


_CHAT = _Form(_TEXT, _chat_capped)
_XML = _Form(_XML_TEXT, _xml_capped, _XML_GUARD, xml_safe_schema, lambda value: xml_escape(value))


def _json_schema_of(schema: dict, form: _Form, cap: int | None = None) -> dict:
    """The `%json` schema of a JSON value: the strict-mode rule, made safe for `form`, `x-max-tokens` its cap
    (prefixrt/constrained/budget.py closes the document within it), the reply's compact layout."""
    out = form.json_schema(strict_schema(schema))
    if cap is not None:
        out = {**out, MAX_TOKENS_KEY: cap}
    return {**out, "x-guidance": {"whitespace_flexible": False, "item_separator": JSON_ITEM_SEPARATOR,
                                  "key_separator": JSON_KEY_SEPARATOR}}


def _json_rule(rule: str, schema: dict, suffix: str, rules: list[str], form: _Form = _CHAT,
               cap: int | None = None) -> str:
    rules.append(f"{rule}: %json {json.dumps(_json_schema_of(schema, form, cap), ensure_ascii=False)} {_lit(suffix)}")
    return rule


def _tool_call_rule(options: list[str], tools: dict[str, dict], between: str, suffix: str,
                    rules: list[str], form: _Form = _CHAT, cap: int | None = None) -> str:
    """ReAct's `next_tool_name` then `next_tool_args` as one rule: each tool name followed by arguments under
    that tool's schema (an open object was closed `{}` at once by a small model, and the call failed)."""
    alts = []
    for k, name in enumerate(options):
        args = _json_rule(f"args_{k}", tools[name], suffix, rules, form, cap)
        alts.append(f"{_lit(form.literal(name) + between)} {args}")
    rules.append("v_next_tool_name: " + " | ".join(alts))
    return "v_next_tool_name"


def _json_note_schema(note: str) -> dict | None:
    """The schema of a field whose note is DSPy's "must adhere to the JSON schema: {...}", else None."""
    if not note.startswith(_JSON_NOTE):
        return None
    try:
        schema = json.loads(note[len(_JSON_NOTE):])
    except ValueError:
        return None
    return schema if isinstance(schema, dict) else None


def _value_rule(name: str, note: str, suffix: str, rules: list[str], cap: int | None = None,
                json_cap: int | None = None, form: _Form = _CHAT) -> str:
    """A rule for one field's value followed by `suffix`; appended to `rules`, its name returned. cap, json_cap: the
    most tokens a text value, a JSON value may take (`value_caps`), or None. form: how the reply spells values."""
    rule = f"v_{name}"
    schema = _json_note_schema(note)
    if schema is not None:
        return _json_rule(rule, schema, suffix, rules, form, json_cap)
    guard = ""
    options = _options(note)
    if note in _SCALARS:
        body = _SCALARS[note].regex
    elif options is not None:
        alts = " | ".join(_lit(form.literal(o)) for o in options)
        rules.append(f"{rule}: ({alts}) {_lit(suffix)}")
        return rule
    else:
        body, guard = form.text, form.guard
        if cap is not None and suffix.startswith("\n") and len(suffix) > 1:
            # llguidance ends a capped suffix-lexeme without its suffix, so the suffix is written out after a
            # greedy text lexeme. Its lexer looks one byte ahead and never backs up: the text keeps an optional
            # final newline and no line of it begins as the suffix's next line does, so the text can end at
            # that newline (before the cap) and the suffix's rest follows.
            nxt = "" if suffix[1] == "\n" else re.escape(suffix[1]).replace("/", "\\/")
            rules += [f"{rule}: {rule}_text {_lit(suffix[1:])}",
                      f"{rule}_text[max_tokens={cap}]: {form.capped(nxt, cap)}"]
            return rule
    rules.append(f"{rule}[suffix={_lit(suffix)}]: {body}{guard}")
    return rule


# ------------------------------------------------------------------------------------------------ the budget

# What `_shortest_json` takes for a string it cannot tell the shortest of (one with a pattern or format).
_UNKNOWN_STRING = '"' + "x" * 14 + '"'


# Tokens a fixed text may take beyond its own tokenization where the reply is counted with the tokenizer: the tokens
# at its two ends may merge with the values around it.
_BOUNDARY_TOKENS = 2


def _size(text: str) -> int:
    return len(text.encode())


def _fixed(text: str, count: Callable[[str], int] | None) -> int:
    """The most tokens a text the grammar writes itself (a header, a tag, the shortest JSON of a value) takes: its
    bytes (a token holds at least one), or fewer with the tokenizer's `count`: its tokens and _BOUNDARY_TOKENS."""
    return min(_size(text), count(text) + _BOUNDARY_TOKENS) if count is not None else _size(text)


def _shortest_json(schema: Any, root: Any = None, depth: int = 0) -> str:
    """The shortest JSON text `schema` accepts (near enough: a string with a pattern or format is a guess), in the
    reply's layout (`, ` and `: `). Objects write their required members, arrays their minItems."""
    root = schema if root is None else root
    if not isinstance(schema, dict) or depth > 32:
        return "0"
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        target = root
        for part in ref[2:].split("/"):
            target = target.get(part, {}) if isinstance(target, dict) else {}
        return _shortest_json(target, root, depth + 1)
    if "const" in schema:
        return json.dumps(schema["const"], ensure_ascii=False)
    if schema.get("enum"):
        return min((json.dumps(v, ensure_ascii=False) for v in schema["enum"]), key=_size)
    for key in ("anyOf", "oneOf"):
        if schema.get(key):
            return min((_shortest_json(b, root, depth + 1) for b in schema[key]), key=_size)
    if schema.get("allOf"):
        return max((_shortest_json(b, root, depth + 1) for b in schema["allOf"]), key=_size)
    kind = schema.get("type")
    if isinstance(kind, list):
        return min((_shortest_json({**schema, "type": k}, root, depth + 1) for k in kind), key=_size)
    if kind == "object" or "properties" in schema:
        props = schema.get("properties") or {}
        members = [f"{json.dumps(k, ensure_ascii=False)}{JSON_KEY_SEPARATOR}"
                   f"{_shortest_json(props.get(k, {}), root, depth + 1)}" for k in schema.get("required") or []]
        return "{" + JSON_ITEM_SEPARATOR.join(members) + "}"
    if kind == "array":
        item = _shortest_json(schema.get("items", {}), root, depth + 1)
        return "[" + JSON_ITEM_SEPARATOR.join([item] * int(schema.get("minItems", 0))) + "]"
    if kind == "string":
        if schema.keys() & {"format"} or schema.get("pattern") not in (None, _XML_SAFE_STRING):
            return _UNKNOWN_STRING
        return '"' + "x" * int(schema.get("minLength", 0)) + '"'
    if kind in ("integer", "number"):
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        return json.dumps(low) if isinstance(low, (int, float)) and low > 0 else "0"
    if kind == "boolean":
        return "true"
    if kind == "null":
        return "null"
    return "0"


def _bounded(note: str, form: _Form) -> int | None:
    """The longest spelling of a bounded value (True/False, an int, a float, a choice) in bytes (a model may spell
    it a byte a token), or None for a free value (text, JSON)."""
    if note in _SCALARS:
        return _SCALARS[note].most_bytes
    options = _options(note)
    if options is not None:
        return max(_size(form.literal(o)) for o in options)
    return None


def value_caps(max_tokens: int | None, fixed: int, bounded: int, texts: int, jsons: list[int]
               ) -> tuple[int | None, int | None]:
    """(the most tokens each text value may take, the most each JSON value may take) so that the reply fits
    `max_tokens` (module docstring, "The budget"): what the format's own text (`fixed` tokens) and the bounded
    values (`bounded` tokens) leave is shared equally, as room beyond each free value's shortest spelling (a text:
    1 token; a JSON value: the longest of `jsons`, the shortest spellings of the reply's JSON values, as they share
    one cap); a tight budget leaves them little room, down to none. (None, None) without max_tokens or free
    values. Raises InvalidRequest where not even the shortest reply fits."""
    if not max_tokens:
        return None, None
    skeleton = max(jsons, default=0)
    free = texts + len(jsons)
    least = fixed + bounded + texts + skeleton * len(jsons)
    if max_tokens < least:
        raise InvalidRequest(
            f"max_tokens={max_tokens} is too small for this DSPy reply format: its shortest reply takes {least} "
            f"tokens ({fixed} for the format's own text, {bounded} for the longest bool, number and choice values, "
            f"{least - fixed - bounded} for the shortest text and JSON values)", param="max_tokens")
    room = (max_tokens - least) // free if free else 0
    return (1 + room if texts else None), (skeleton + room if jsons else None)


# (JSONAdapter, `text_cap`) Tokens a field's key and the separators around it take, roughly.
_HEADER_TOKENS = 12


def text_cap(fields: list[str], max_tokens: int | None) -> int | None:
    """JSONAdapter's cap on each plain string, in characters: an equal share of what the field names and the
    separators leave of `max_tokens` (at least 8); None without a budget. (The reply is one JSON document, which
    BudgetMatcher closes within max_tokens; the cap keeps the first string from taking it all.)"""
    if not max_tokens:
        return None
    return max(8, (max_tokens - _HEADER_TOKENS * (len(fields) + 1)) // max(1, len(fields)))


def _options(note: str) -> list[str] | None:
    for lead in ("must exactly match (no extra characters) one of: ", "must be one of: "):
        if note.startswith(lead):
            return note[len(lead):].split("; ")
    return None


def _fields_grammar(fields: list[str], notes: dict[str, str], tools: dict[str, dict], first: str, after,
                    max_tokens: int | None = None, form: _Form = _CHAT, count: Callable[[str], int] | None = None
                    ) -> str:
    """`first` then each field's value followed by `after(k)` (the text between field k and the next, or the
    end), each free value capped by `value_caps` within max_tokens. dspy.ReAct's next_tool_name +
    next_tool_args pair becomes one rule when every option is a known tool. form: how the reply spells values.
    count: the tokenizer's token count of a text, or None (`_fixed`)."""
    slots = []  # (k, tool-call pair?)
    k = 0
    while k < len(fields):
        options = _options(notes.get(fields[k], ""))
        pair = (fields[k] == "next_tool_name" and fields[k + 1:k + 2] == ["next_tool_args"] and options
                and all(o in tools for o in options))
        slots.append((k, bool(pair)))
        k += 2 if pair else 1
    fixed = _fixed(first, count) + sum(_fixed(after(k), count) for k in range(len(fields)))
    bounded, texts, jsons = 0, 0, []
    for k, pair in slots:
        if pair:
            options = _options(notes[fields[k]])
            bounded += max(_size(form.literal(o)) for o in options)
            jsons.append(max(_fixed(_shortest_json(_json_schema_of(tools[o], form)), count) for o in options))
            continue
        note = notes.get(fields[k], "")
        schema = _json_note_schema(note)
        if schema is not None:
            jsons.append(_fixed(_shortest_json(_json_schema_of(schema, form)), count))
        elif (most := _bounded(note, form)) is not None:
            bounded += most
        else:
            texts += 1
    text_cap, json_cap = value_caps(max_tokens, fixed, bounded, texts, jsons)
    rules: list[str] = []
    seq = []
    for k, pair in slots:
        if pair:
            seq.append(_tool_call_rule(_options(notes[fields[k]]), tools, after(k), after(k + 1), rules, form,
                                       json_cap))
        else:
            seq.append(_value_rule(fields[k], notes.get(fields[k], ""), after(k), rules, text_cap, json_cap, form))
    return "\n".join([f"start: {_lit(first)} " + " ".join(seq), *rules])


def chat_adapter_grammar(fields: list[str], notes: dict[str, str], tools: dict[str, dict] | None = None,
                         max_tokens: int | None = None, count_tokens: Callable[[str], int] | None = None) -> str:
    def after(k: int) -> str:
        return f"\n\n[[ ## {fields[k + 1]} ## ]]\n" if k + 1 < len(fields) else "\n\n[[ ## completed ## ]]"

    return _fields_grammar(fields, notes, tools or {}, f"[[ ## {fields[0]} ## ]]\n", after, max_tokens,
                           count=count_tokens)


def xml_adapter_grammar(fields: list[str], notes: dict[str, str], tools: dict[str, dict] | None = None,
                        max_tokens: int | None = None, count_tokens: Callable[[str], int] | None = None) -> str:
    """notes: as _notes reads them, with a nested field's (nested_field_schemas) as a JSON-schema note: its value
    is JSON text, which XMLAdapter reads as the field's value when the element holds no child elements."""
    def after(k: int) -> str:
        return f"\n</{fields[k]}>" + (f"\n<{fields[k + 1]}>\n" if k + 1 < len(fields) else "")

    return _fields_grammar(fields, notes, tools or {}, f"<{fields[0]}>\n", after, max_tokens, _XML, count_tokens)


def output_format_constraint(messages: list[dict], max_tokens: int | None = None,
                             nested_schemas: dict[str, dict] | None = None,
                             count_tokens: Callable[[str], int] | None = None) -> dict:
    """{"grammar": ...} for the reply format a DSPy adapter asked for in `messages`, or {}. max_tokens: the
    reply's budget; every free value is then capped (`value_caps`) so that the whole reply fits it (a small model
    otherwise writes the first text field until max_tokens, and the reply does not parse); InvalidRequest where
    it cannot. nested_schemas: for XMLAdapter, the JSON schemas of its nested fields where the caller knows them
    (the signature's types); otherwise they are read from the prompt (`nested_field_schemas`). count_tokens: the
    model's tokenizer as a count of a text's tokens, where the caller has it (the format's own text is otherwise
    counted in bytes, a bound for any tokenizer)."""
    users = [m for m in messages if m.get("role") == "user"]
    if not users:
        return {}
    last = users[-1].get("content") or ""
    system = "\n".join(m.get("content") or "" for m in messages if m.get("role") == "system")
    m = _CHAT_REQUEST.search(last)
    if m:
        fields = _CHAT_FIELD.findall(m.group(1))
        if fields:
            return {"grammar": chat_adapter_grammar(fields, _notes(system), _react_tools(system), max_tokens,
                                                    count_tokens)}
    m = _XML_REQUEST.search(last)
    if m:
        fields = _XML_FIELD.findall(m.group(1))
        if fields:
            notes = _notes(system)
            for name, schema in nested_field_schemas(last, system, nested_schemas).items():
                if name in fields:
                    notes[name] = _JSON_NOTE + json.dumps(schema, ensure_ascii=False)
            return {"grammar": xml_adapter_grammar(fields, notes, _react_tools(system), max_tokens, count_tokens)}
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
    if note.startswith(_JSON_NOTE):
        return _json_note_schema(note) or {}
    if note in _SCALARS:
        return dict(_SCALARS[note].schema)
    options = _options(note)
    if options is not None:
        return {"enum": options}
    return {"type": "string"} if note == "" else {}


def json_adapter_schema(messages: list[dict], max_tokens: int | None = None) -> dict | None:
    """The JSON schema of the reply JSONAdapter asked for in `messages` (its output fields, in order, typed from
    their notes, all required, no others), or None when the messages are not JSONAdapter's. max_tokens: the
    reply's budget; each plain string (a text field, a ReAct tool's string argument) then has a maxLength of
    `text_cap` characters, so the first text field leaves the others room (a small model otherwise writes it until
    max_tokens); the engine's BudgetMatcher closes the object within the budget."""
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
