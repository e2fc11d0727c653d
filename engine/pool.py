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
not from the engine's device, so a pool of vLLM engines is refused, and so is a vLLM
engine on any GPU but the first visible one: use one process per GPU for vLLM.

A pool of engines does not combine with `stage_devices`: every worker would build its
own copy of the stage on every stage device, each GPU then hosting as many flows and
vocoders as there are workers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path
from typing import Any, Sequence

import torch

from .config import EngineConfig
from .engine import Engine
from .errors import EngineError
from .session import Session
from .stage_pool import normalised_device
from .stats import EngineStats
from .types import SessionOptions, VoicePrompt

log = logging.getLogger(__name__)


def _device(name: str) -> torch.device:
    try:
        return normalised_device(name)
    except ValueError as exc:
        raise EngineError("bad_config", str(exc)) from None


def pool_configs(base: EngineConfig, devices: Sequence[str]) -> list[EngineConfig]:
    """One config per device (the base config with its device replaced), or the base
    alone for no device; checked here, before any model loads (`gateway.__main__` runs it
    before the download too), as the workers would only fail, or silently share a GPU,
    once loaded."""
    if len(devices) > 1 and base.stage_devices:
        raise EngineError("bad_config", "engine.devices (one engine per device) does not combine with "
                                        "engine.stage_devices: every engine would put a stage copy on every stage "
                                        "device; use one or the other")
    # By the hardware named, not the spelling: `cuda` and `cuda:0` are one GPU. CPU
    # workers share the CPU (the tests' pools).
    gpus = [str(d) for d in map(_device, devices) if d.type != "cpu"]
    if len(set(gpus)) != len(gpus):
        raise EngineError("bad_config", f"a GPU may host only one engine: {', '.join(devices)}")
    configs = [dataclasses.replace(base, device=d) for d in devices] or [base]
    if len(configs) > 1:
        # A profile folder per worker: each one's stages count from stage0, and the workers'
        # profiles would overwrite each other in <dir>/stage0.
        configs = [dataclasses.replace(c, stage_profile_dir=str(Path(c.stage_profile_dir) / f"worker{i}"))
                   if c.stage_profile_dir else c for i, c in enumerate(configs)]
    if len(configs) > 1 and any(c.resolved_backend() == "vllm" for c in configs):
        raise EngineError("bad_config", "the vLLM backend cannot be pooled in one process; "
                                        "run one gateway per GPU (CUDA_VISIBLE_DEVICES) behind a load balancer")
    # vLLM takes the first GPU the process sees whatever the engine's device says: on
    # cuda:N the LM would run on GPU 0 instead, beside whatever else is there. (The backend
    # is resolved for such a device only: `auto` imports vLLM to see whether it is there.)
    device = None if configs[0].device == "auto" else _device(configs[0].device)
    if (len(configs) == 1 and device is not None and device.type == "cuda" and device.index != 0
            and configs[0].resolved_backend() == "vllm"):
        raise EngineError("bad_config", f"the vLLM backend runs on the first GPU the process sees, not on "
                                        f"{configs[0].device}: give the process that GPU alone "
                                        f"(CUDA_VISIBLE_DEVICES={device.index}) and use device cuda")
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
        """`Engine.prepare_voice` for the whole pool: the features once (they are the same on
        every worker), then the voice warmed (graphs, prompt cache) on every ready worker
        side by side, each on its own GPU: a worker left out would capture while serving,
        its sessions' first chunks waiting on it."""
        workers = [e for e in self.engines if e.ready]
        if not workers:
            raise EngineError("not_ready", self._not_ready_reason())
        voice = await workers[0].featurize_voice(voice_id, wav, sample_rate, transcript)
        # Every worker's warm-up runs to its end before a failure is raised: none is left
        # capturing behind a registration that already answered.
        results = await asyncio.gather(*(e.warm_voice(voice) for e in workers), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return voice

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
            raise EngineError("not_ready", self._not_ready_reason())
        return self._least_loaded().open_session(voice, options)

    def _not_ready_reason(self) -> str:
        """Why the pool takes no session, worded as `Engine.open_session` words it: the failed
        workers and why; else still loading (only a pool built of engines not yet started:
        `create` starts every one first) or draining (SIGTERM, or a worker set not ready)."""
        if self.failure is not None:
            return self.failure
        if any(not e._started for e in self.engines):
            return "engine workers are still loading"
        idle = [str(i) for i, e in enumerate(self.engines) if not e.ready]
        if len(idle) == len(self.engines):
            return "engine is not serving (draining)"
        return f"engine workers not serving (draining): {', '.join(idle)}"

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
        """Close every worker, also when one's close fails (each one's LM and stage stop
        whatever the others do); a failure is logged, not raised, as the others closed."""
        results = await asyncio.gather(*(e.close() for e in self.engines), return_exceptions=True)
        for i, result in enumerate(results):
            if isinstance(result, BaseException):
                log.error("closing engine worker %d (%s) failed", i, self.engines[i].device,
                          exc_info=(type(result), result, result.__traceback__))


def _is_extreme(name: str) -> bool:
    """An EngineStats field that is a latest or largest value, not a count or an occupancy:
    batch-size extremes, the planner's latest inputs, the vocoder holdback it learnt, and
    the start's step times (the slowest worker's; `create` starts the workers one after
    another, so the whole start took about their sum)."""
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
