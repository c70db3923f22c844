"""SessionService: the service each session has had, for scheduling sessions rather than requests.

Requests that carry one session key (SamplingParams.prompt_cache.session: OpenAI's prompt_cache_key, Anthropic's
metadata.user_id) are the turns of one session: they share one priority, the session's attained service (tokens
it has had computed: prompt chunks and decode steps), and waiting requests go least attained service first (as
program-aware schedulers order LLM programs), so one long agent does not hold back many short ones. A request
without a key is a session of its own, which has had nothing yet. Aging (schedule_policy.py) still bounds any
wait. Bounded: the least recently charged sessions are forgotten past `max_sessions` (they start again at 0).
"""

from __future__ import annotations

from collections import OrderedDict

from prefixrt.request import Req


def session_of(req: Req) -> str | None:
    pc = req.params.prompt_cache
    return pc.session if pc is not None else None


class SessionService:
    def __init__(self, max_sessions: int = 65536):
        self.max_sessions = max_sessions
        self._tokens: OrderedDict[str, int] = OrderedDict()

    def charge(self, req: Req, num_tokens: int) -> None:
        """req's session had num_tokens computed (a forward fed them)."""
        key = session_of(req)
        if key is None or num_tokens <= 0:
            return
        self._tokens[key] = self._tokens.get(key, 0) + num_tokens
        self._tokens.move_to_end(key)
        while len(self._tokens) > self.max_sessions:
            self._tokens.popitem(last=False)

    def service(self, req: Req) -> int:
        """Tokens req's session has had computed so far (0 for a request without a session key)."""
        key = session_of(req)
        return self._tokens.get(key, 0) if key is not None else 0

    def __len__(self) -> int:
        return len(self._tokens)
