"""Lowering: requests in their callers' vocabularies (OpenAI's chat, completions and Responses APIs, DSPy,
LangChain) -> what the engine takes (prompt messages or ids, SamplingParams, a constraint), and the reply read
back in that vocabulary (tool calls, reasoning). The HTTP routes (prefixrt/server/) and the adapters
(adapters/) are thin callers: each turns its own request into OpenAI-shaped dicts and calls one function here.

One module per concept; import the module you need (this package re-exports nothing):

  options.py         option names -> SamplingParams fields, each checked once; the output budget (max_new_tokens)
  chat.py            a chat request: messages, tools and response format (lower_chat); the whole OpenAI request
  completion.py      a legacy completions request: its prompts and options
  sglang.py          SGLang's native /generate request: its prompts, sampling names and logprob fields
  messages.py        chat messages -> what a chat template renders; the Responses API's input items
  tools.py           tools / tool_choice -> a ToolPlan (constraint, call syntax) and the calls read back
  constraints.py     response formats -> a constraint; one constraint per request
  json_schema.py     schemas as users give them (dict, JSON text, pydantic class) -> the schema; the strict rule
  tool_formats.py    model families' own tool-call syntax: detect a template's, parse a reply's calls
  tool_stream.py     tool calls read while they stream: each call's name, then its arguments' text as it grows
  reasoning.py       reasoning parsers: a reply's thinking and its answer, whole or streamed
  choice_scoring.py  scoring `choices` from their tokens' logprobs
  text_checks.py     checks on user text and JSON values (valid Unicode, no NUL, bounded nesting)

json_schema, text_checks and choice_scoring are records-level (params.py and the engine use them);
tool_formats, tool_stream and reasoning are pure text; the rest lower whole requests.
"""
