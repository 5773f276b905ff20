"""Errors the engine raises to its callers."""


class InvalidRequestError(ValueError):
    """The request itself is bad (empty or too long prompt, bad sampling parameters)."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full: retry later."""


class EngineDeadError(RuntimeError):
    """The engine loop crashed; it accepts no more requests."""
