"""Exceptions that cross the public API."""


class InvalidRequest(ValueError):
    """A request the engine refuses before scheduling anything (bad prompt, bad parameter, bad constraint).

    The engine is untouched by it: nothing was allocated, no other request is affected.
    `param` names the offending field when there is one (it becomes the OpenAI error's `param`).
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param

    def __reduce__(self):  # keep `param` when pickled (the engine process sends errors to the server)
        return (type(self), (self.message, self.param))


class EngineDeadError(RuntimeError):
    """The scheduler loop stopped (shutdown, or a bug that escaped per-request isolation)."""


# The error prefix of a request failed because its engine stopped answering or making progress (the engine may
# come back; the request does not): the server answers it with 503 `engine_unresponsive`.
ENGINE_UNRESPONSIVE = "engine unresponsive"
