"""The engine's user errors: a request it cannot serve as asked, and a session stepped out of turn.

Both are :class:`~eyas.errors.EyasError`, so the CLI prints them as one line (what was expected, what
was found) instead of a traceback; RequestError is also a ValueError, as it always was."""

from __future__ import annotations

from eyas.errors import EyasError


class RequestError(EyasError, ValueError):
    """A request the engine cannot serve as asked: sampling parameters out of range, an empty prompt or
    one longer than the target's context, a drafter that does not fit the target, an unknown timing."""


class SessionError(EyasError, RuntimeError):
    """A session stepped when the target's cache holds another one."""
