"""Telling a failure of torch.compile's machinery from a failure of the computation."""

from __future__ import annotations


def is_compile_error(exc: BaseException) -> bool:
    """Whether `exc` comes from torch.compile's machinery (dynamo, inductor, a backend):
    no Triton, no C compiler, an unsupported operator. Not an out-of-memory error of the
    computation itself, which the caller must see."""
    return any(type(e).__module__.startswith(("torch._dynamo", "torch._inductor"))
               for e in (exc, exc.__cause__) if e is not None)
