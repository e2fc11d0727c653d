"""Several engines in one process, one per device, behind the `Engine` interface.

A node with several GPUs can run one gateway process per GPU behind a load balancer
(the docker-compose `cluster` profile), or one process with an `EnginePool`: one full
`Engine` (models, LM backend, audio stage) per device, and each new session placed on
the least-loaded one. The gateway uses the pool exactly like a single engine.

Placement is per session (a WebSocket context or one HTTP speech request): a session
keeps its engine for its lifetime, because its LM state and audio history live there.
"Least loaded" is the fewest open sessions, then the fewest utterances in flight, then
the lowest index, so equal workers fill evenly and placement is deterministic.

Readiness: the pool is ready only when every worker is, so a node that lost a GPU
reports not-ready (and is restarted by its orchestrator) instead of silently serving
at a fraction of its capacity.

The vLLM backend picks its GPU from the process environment (CUDA_VISIBLE_DEVICES),
not from the engine's device, so a pool of vLLM engines is refused: use one process
per GPU for vLLM.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Sequence

from .config import EngineConfig
from .engine import Engine, EngineError, EngineStats, Session
from .types import SessionOptions, VoicePrompt


def pool_configs(base: EngineConfig, devices: Sequence[str]) -> list[EngineConfig]:
    """One config per device (the base config with its device replaced)."""
    if not devices:
        return [base]
    if len(set(devices)) != len(devices) and not all(d == "cpu" for d in devices):
        raise EngineError("bad_config", f"a GPU may host only one engine: {', '.join(devices)}")
    configs = [dataclasses.replace(base, device=d) for d in devices]
    if len(configs) > 1 and any(c.resolved_backend() == "vllm" for c in configs):
        raise EngineError("bad_config", "the vLLM backend cannot be pooled in one process; "
                                        "run one gateway per GPU (CUDA_VISIBLE_DEVICES) behind a load balancer")
    return configs


class EnginePool:
    """N engines, one per device; duck-types the parts of `Engine` the gateway uses."""

    def __init__(self, engines: Sequence[Engine]) -> None:
        if not engines:
            raise ValueError("an EnginePool needs at least one engine")
        self.engines: tuple[Engine, ...] = tuple(engines)
        first = self.engines[0]
        # Every worker loads the same model directory; these are the same on all.
        self.config = first.config
        self.sample_rate = first.sample_rate
        self.model_name = first.model_name
        self.backend = first.backend

    @classmethod
    async def create(cls, configs: Sequence[EngineConfig]) -> "EnginePool":
        """Load one engine per config, one after another (loading is CPU- and I/O-bound,
        and a sequential start gives a clear error for the worker that fails)."""
        engines: list[Engine] = []
        try:
            for cfg in configs:
                engines.append(await Engine.create(cfg))
        except BaseException:
            await asyncio.gather(*(e.close() for e in engines), return_exceptions=True)
            raise
        return cls(engines)

    # -- what the gateway reads ------------------------------------------------------
    @property
    def ready(self) -> bool:
        return all(e.ready for e in self.engines)

    @ready.setter
    def ready(self, value: bool) -> None:
        """False: the gateway drains (SIGTERM); no worker takes a new session."""
        for e in self.engines:
            e.ready = value

    @property
    def failure(self) -> str | None:
        """The failed workers and why; None while all can serve."""
        failures = [f"worker {i}: {e.failure}" for i, e in enumerate(self.engines) if e.failure is not None]
        return "; ".join(failures) or None

    @property
    def workers_ready(self) -> list[bool]:
        return [e.ready for e in self.engines]

    @property
    def device(self) -> str:
        return ",".join(str(e.device) for e in self.engines)

    def text_ids(self, text: str) -> list[int]:
        return self.engines[0].text_ids(text)

    @property
    def features_id(self) -> str:
        return self.engines[0].features_id

    def voice_from_arrays(self, voice_id: str, transcript: str, speech_tokens: Any, speech_feat: Any,
                          embedding: Any) -> VoicePrompt:
        # Prompts are device-independent CPU tensors; any worker can build them.
        return self.engines[0].voice_from_arrays(voice_id, transcript, speech_tokens, speech_feat, embedding)

    async def prepare_voice(self, voice_id: str, wav: Any, sample_rate: int, transcript: str) -> VoicePrompt:
        return await self._least_loaded().prepare_voice(voice_id, wav, sample_rate, transcript)

    # -- placement ----------------------------------------------------------------------
    def loads(self) -> list[tuple[int, int]]:
        """(open sessions, utterances in flight) per worker."""
        out = []
        for e in self.engines:
            st = e.stats()
            out.append((st.active_sessions, st.active_utterances))
        return out

    def _least_loaded(self) -> Engine:
        candidates = [(load, i) for i, load in enumerate(self.loads()) if self.engines[i].ready]
        if not candidates:
            raise EngineError("not_ready", "no engine worker is ready")
        return self.engines[min(candidates)[1]]

    def open_session(self, voice: VoicePrompt, options: SessionOptions | None = None) -> Session:
        if not self.ready:
            raise EngineError("not_ready", "engine workers are still loading")
        return self._least_loaded().open_session(voice, options)

    # -- stats and shutdown ----------------------------------------------------------
    def stats(self) -> EngineStats:
        """The workers' stats as one engine's (`combined_stats`)."""
        return combined_stats([e.stats() for e in self.engines])

    def worker_stats(self) -> list[EngineStats]:
        return [e.stats() for e in self.engines]

    def tune_planner(self, knobs: dict[str, object]) -> None:
        """Every worker's (`Engine.tune_planner`). The workers share one configuration, so
        knobs one refuses the first refuses, before any is set."""
        for e in self.engines:
            e.tune_planner(knobs)

    def planner_state(self) -> dict[str, object]:
        """Each worker's (`Engine.planner_state`): each plans on its own stage."""
        return {"workers": [e.planner_state() for e in self.engines]}

    async def close(self) -> None:
        await asyncio.gather(*(e.close() for e in self.engines), return_exceptions=True)


def _is_extreme(name: str) -> bool:
    """An EngineStats field that is a latest or largest value, not a count or an occupancy:
    batch-size extremes, the planner's latest inputs, the vocoder holdback it learnt, and
    the start's step times (the workers start side by side)."""
    return (name in ("last_batch_size", "max_batch_size", "first_chunk_holdback_seconds")
            or "_plan_" in name or (name.startswith("start_") and name.endswith("_seconds")))


def combined_stats(per: Sequence[EngineStats]) -> EngineStats:
    """The workers' counters and occupancies added up; for a latest or largest value the
    largest of the workers' (a sum of N workers' latest plans read N times too high)."""
    total: dict[str, Any] = {}
    for f in dataclasses.fields(EngineStats):
        values = [getattr(s, f.name) for s in per]
        total[f.name] = max(values) if _is_extreme(f.name) else sum(values)
    return EngineStats(**total)


async def create_engine(base: EngineConfig, devices: Sequence[str] = ()) -> Engine | EnginePool:
    """A single `Engine` for zero or one device, else an `EnginePool`."""
    configs = pool_configs(base, devices)
    if len(configs) == 1:
        return await Engine.create(configs[0])
    return await EnginePool.create(configs)
