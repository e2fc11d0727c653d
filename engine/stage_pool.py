"""Several audio stages behind the one-stage interface: the flow+vocoder work on more GPUs.

The flow+vocoder stage is the engine's bottleneck (the LM runs at a fraction of its
capacity while the stage is saturated), so the cheapest use of a second GPU is a second
copy of the stage: each utterance is placed on the stage with the fewest live
utterances when its vocoder stream is created, and all of its chunks run there (the
vocoder's per-utterance state lives on that stage's device). The LM backend is shared.

`StagePool` offers what `Engine` uses of an `AudioStage`: `new_stream`, `submit`, `run`,
`round_estimate`, `live_utterances`, `expect_first_chunk`, `drop_cancelled`, `pending_for`, `stats`,
`warm_graphs`, `warm_prompt`, `start`, `started`, `close`.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import torch

from .config import EngineConfig
from .models.loader import LoadedModel
from .stage_build import audio_stage
from .token2wav import AudioStage, ChunkJob, StageStats, check_stage_knobs

if TYPE_CHECKING:
    from .stage_process import RemoteStage


def normalised_device(device: str | torch.device) -> torch.device:
    """`device` as the hardware it names: an index-less accelerator (`cuda`) is its first
    one (`cuda:0`), and the CPU is one (`cpu:0` is `cpu`). torch compares the spelling:
    `torch.device("cuda") == torch.device("cuda:0")` is False. Raises ValueError for a
    name torch does not take (`cuda:01`, `auto`)."""
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"{str(device)!r} is not a device: {exc}") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    # `cuda` is the current device, cuda:0 unless torch.cuda.set_device said otherwise,
    # which this process never does (a GPU is picked by name or CUDA_VISIBLE_DEVICES).
    return dev if dev.index is not None else torch.device(dev.type, 0)


def build_stage(model: LoadedModel, device: torch.device, config: EngineConfig) -> AudioStage | StagePool:
    """The flow+vocoder stage in this process: one on `device`, or a pool of one copy per
    device of `config.stage_devices`."""
    if not config.stage_devices:
        return audio_stage(model, device, config)
    stages = []
    own_taken = False
    for name in config.stage_devices:
        dev = torch.device(name)
        # The model's own flow and vocoder already sit on `device`: the first stage there
        # takes them, not a second copy beside them (`cuda:0` and a `cuda` engine are one GPU).
        own = not own_taken and normalised_device(dev) == normalised_device(device)
        own_taken = own_taken or own
        flow = model.flow if own else copy.deepcopy(model.flow).to(dev)
        hift = model.hift if own else copy.deepcopy(model.hift).to(dev)
        stages.append(audio_stage(model, dev, config, flow, hift, len(stages)))
    return StagePool(stages)


class PooledStream:
    """A vocoder stream bound to one stage of the pool."""

    __slots__ = ("stage_index", "inner")

    def __init__(self, stage_index: int, inner: object) -> None:
        self.stage_index = stage_index
        self.inner = inner


class StagePool:
    def __init__(self, stages: list[AudioStage] | list[RemoteStage]) -> None:
        if not stages:
            raise ValueError("a stage pool needs at least one stage")
        self.stages = stages
        # New streams go to this stage whatever the load (the engine's warm-up, which teaches
        # each stage its own rounds); None: to the least-loaded one.
        self.pinned: int | None = None

    @property
    def devices(self) -> list[object]:
        return [s.device for s in self.stages]

    def load(self) -> list[int]:
        """Live utterances per stage."""
        return [s.live_utterances() for s in self.stages]

    def live_utterances(self, stream: object | None = None, skip_patient: bool = False) -> int:
        """Live utterances on the stage `stream` is bound to (None: on all of them), less
        with `skip_patient` those waiting patiently (`AudioStage.live_utterances`)."""
        if stream is None:
            return sum(stage.live_utterances(skip_patient=skip_patient) for stage in self.stages)
        if not isinstance(stream, PooledStream):
            raise TypeError("stream must come from StagePool.new_stream()")
        return self.stages[stream.stage_index].live_utterances(skip_patient=skip_patient)

    def new_stream(self) -> PooledStream:
        if self.pinned is not None:
            return PooledStream(self.pinned, self.stages[self.pinned].new_stream())
        # A stage whose process died has no live utterances left, so by load alone it
        # would take every new one and fail it: only working stages are candidates.
        working = [(n, i) for i, n in enumerate(self.load()) if getattr(self.stages[i], "failure", None) is None]
        index = min(working)[1] if working else 0  # none works: its submit says why
        return PooledStream(index, self.stages[index].new_stream())

    @property
    def failure(self) -> str | None:
        """Why no stage can serve (every one failed); None while one can."""
        failures = [getattr(s, "failure", None) for s in self.stages]
        return None if None in failures else "; ".join(str(f) for f in failures)

    def submit(self, job: ChunkJob) -> asyncio.Future[np.ndarray]:
        """`AudioStage.submit` on the stage the job's stream is bound to (one stage runs
        all of an utterance's chunks, in order)."""
        pooled = job.hift_stream
        if not isinstance(pooled, PooledStream):
            raise TypeError("job.hift_stream must come from StagePool.new_stream()")
        inner = dataclasses.replace(job, hift_stream=pooled.inner)
        future = self.stages[pooled.stage_index].submit(inner)
        job.future, job.started = inner.future, inner.started  # the copy's: the caller waits on them
        return future

    async def run(self, job: ChunkJob) -> np.ndarray:
        return await self.submit(job)

    def round_estimate(self, stream: object, frames: int, cached: int = 0,
                       skip_patient: bool = False, due_rounds: bool = False) -> float | None:
        """`AudioStage.round_estimate` of the stage the stream is bound to."""
        if not isinstance(stream, PooledStream):
            raise TypeError("stream must come from StagePool.new_stream()")
        return self.stages[stream.stage_index].round_estimate(stream.inner, frames, cached, skip_patient, due_rounds)

    def expect_first_chunk(self, stream: object, due: float, round_s: float | None = None,
                           urgent: bool = True) -> None:
        """`AudioStage.expect_first_chunk` on the stage the stream is bound to."""
        if not isinstance(stream, PooledStream):
            raise TypeError("stream must come from StagePool.new_stream()")
        self.stages[stream.stage_index].expect_first_chunk(stream.inner, due, round_s, urgent)

    def drop_cancelled(self) -> int:
        return sum(s.drop_cancelled() for s in self.stages)

    def pending_for(self, is_cancelled: object) -> int:
        return sum(s.pending_for(is_cancelled) for s in self.stages)

    def started(self) -> None:
        """`AudioStage.started` of every stage."""
        for stage in self.stages:
            stage.started()

    def tune(self, knobs: dict[str, object]) -> None:
        """`AudioStage.tune` of every stage."""
        check_stage_knobs(knobs)  # before any is set
        for stage in self.stages:
            stage.tune(knobs)

    @property
    def stats(self) -> StageStats:
        """Counters summed over the stages (maxima for the `max_`/`last_` gauges)."""
        total = StageStats()
        for f in dataclasses.fields(StageStats):
            values = [getattr(s.stats, f.name) for s in self.stages]
            merged = max(values) if f.name.startswith(("max_", "last_")) else sum(values)
            setattr(total, f.name, merged)
        return total

    @property
    def cuda_memory(self) -> dict[str, int]:
        """CUDA bytes of the stages in processes of their own, summed (`RemoteStage`); the
        engine's process counts stages of its own itself."""
        total: dict[str, int] = {}
        for stage in self.stages:
            for key, n in getattr(stage, "cuda_memory", {}).items():
                total[key] = total.get(key, 0) + n
        return total

    def _serving(self) -> list[AudioStage | RemoteStage]:
        """The stages that can still serve: a dead one (its process exited) takes no work, and
        warming it would fail a voice's registration on the stages that can."""
        return [s for s in self.stages if getattr(s, "failure", None) is None]

    async def warm_graphs(self, shapes: list[tuple[int, ...]]) -> int:
        """Capture the flow graphs for these batch shapes on every stage that serves."""
        return sum([await s.warm_graphs(shapes) for s in self._serving()])

    async def warm_prompt(self, chunk: object) -> bool:
        """Build the voice's flow prompt cache entry on every stage that serves."""
        return all([await s.warm_prompt(chunk) for s in self._serving()])

    async def warm_context(self, prompt: object) -> bool:
        """Compile the flow's context-cache calls on every stage that serves (see AudioStage.warm_context)."""
        return all([await s.warm_context(prompt) for s in self._serving()])

    async def start(self) -> None:
        for s in self.stages:
            await s.start()

    async def close(self) -> None:
        """Close every stage, also when one's close fails: a stage left open keeps its
        process, which the interpreter's exit would then wait for."""
        errors: list[BaseException] = []
        for s in self.stages:
            try:
                await s.close()
            except BaseException as exc:  # a cancel too: the other stages still close
                errors.append(exc)
        if errors:
            raise errors[0]
