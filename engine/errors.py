"""The engine's refusals and failures, with a code the gateway sends on (`EngineError.code`)."""

from __future__ import annotations


class EngineError(RuntimeError):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
