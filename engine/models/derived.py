"""Values computed from a parameter once and kept while it stays the same.

Kernels that want a weight in another layout (the vocoder's channels-last convolutions, the
DiT's packed position convolution), or activations that want a parameter reshaped and
inverted (the vocoder's Snakes), would otherwise redo that on every call: a copy or a few
small kernels each, and for a CUDA graph a new address on every capture. Made on the first
call, which for a graph is its eager warm-up, so a graph reads what its capture made; the
stage's weights do not change after its graphs are captured.
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

import torch

T = TypeVar("T")


class DerivedTensor(Generic[T]):
    """A value derived from one parameter, made again only when the parameter changes.

    Valid while the parameter is the same tensor over the same storage (a move or a cast
    replaces one of them, or its `.data`; the key holds the old storage, so its address
    cannot come back) at the same version (a load or an in-place update bumps it; one made
    through `.data` does not, and is not seen). A parameter made under inference_mode has no
    version counter, so its value is made on every call. Values carry no gradient: what
    uses them is inference-only."""

    def __init__(self) -> None:
        self._key: tuple[torch.Tensor, torch.Tensor, int, int] | None = None
        self._value: T | None = None

    def get(self, source: torch.Tensor, make: Callable[[torch.Tensor], T]) -> T:
        if source.is_inference():
            return make(source)
        key = self._key
        if (self._value is None or key is None or key[0] is not source or key[2] != source._version
                or key[3] != source.data_ptr()):
            with torch.no_grad():
                self._value = make(source.detach())
            self._key = (source, source.detach(), source._version, source.data_ptr())
        return self._value
