"""The default models, by role: the one place their names are written. Both are embedded catalogue entries
(hub/catalogue.py builds them from Python packages, nothing is downloaded).

- BASE_MODEL: a base model for plain-text completion; the default of `Engine()`, `EngineConfig`,
  `prefixrt generate` without --chat and `prefixrt bench`.
- CHAT_MODEL: an instruct model; the default wherever a chat is expected: `prefixrt serve`, `prefixrt chat`,
  `prefixrt generate --chat`, `prefixrt.openai.OpenAI()`.
"""

from __future__ import annotations

BASE_MODEL = "gemma-3-270m"
CHAT_MODEL = "smollm2-135m-instruct"
