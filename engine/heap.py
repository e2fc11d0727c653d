"""Keeping a server's start-up objects out of the cyclic garbage collector's full passes.

A full pass (generation 2) walks every container object the process holds, and holds the
GIL while it does: the event loop, the audio stage's worker thread and the encoders all
wait. After start-up most of those objects are torch's, vLLM's and the models' (on this
project's CPU machine, torch and the gateway's modules alone are ~196,000 objects and a full
pass takes 45-63 ms), and none of them will become garbage while the process serves.
`gc.freeze` moves them to a generation the collector never walks.
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> int:
    """Collect what start-up left behind, then exempt every object alive now from later
    passes (`gc.freeze`); returns how many objects are exempt in all."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def unfreeze() -> None:
    """Give the exempt objects back to the collector (`gc.unfreeze`): a server shutting
    down in a process that goes on (tests, an embedding application) must not keep its
    objects uncollectable."""
    gc.unfreeze()
