"""What the Triton kernels of the flow and the vocoder share: building a kernel where Triton
imports, running under its CPU interpreter (tests), and telling a kernel that cannot run
here from a computation that failed."""

from __future__ import annotations

import os
from typing import Any, Callable


def build(make: Callable[[Any, Any], Any]) -> Any | None:
    """`make(triton, triton.language)`, the kernel it defines; None where Triton does not
    import (callers cache the result: a kernel is defined once per process)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    return make(triton, tl)


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (set before Triton is imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def is_kernel_error(exc: BaseException) -> bool:
    """Whether `exc` says the kernel cannot run here (Triton failed to compile or launch it:
    an older Triton, an unsupported GPU, too little shared memory), not that the
    computation failed (out of memory), which the caller must see."""
    return any(type(e).__module__.startswith("triton") for e in (exc, exc.__cause__) if e is not None)
