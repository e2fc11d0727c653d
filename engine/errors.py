"""The engine's refusals and failures, with a code the gateway sends on (`EngineError.code`)."""

from __future__ import annotations


class EngineError(RuntimeError):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def released(exc: BaseException) -> BaseException:
    """`exc` and the exceptions it was raised from, their tracebacks dropped: a traceback
    holds its frames, whose locals can hold what holds the exception (a task, a future),
    a cycle that keeps tensors and stage streams alive until a full garbage collection."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        link.__traceback__ = None
        link = link.__cause__ or link.__context__
    return exc
