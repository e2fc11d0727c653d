"""The garbage collector in the gateway process: start-up objects exempt from its passes
(`engine.heap`), and its passes timed into /metrics (`gateway.gc_pauses`)."""

from __future__ import annotations

import gc
from pathlib import Path

from engine.heap import freeze_startup_objects, unfreeze
from gateway.gc_pauses import GcPauses
from gateway.metrics import Metrics
from tests.helpers import live_gateway, scrape


def test_passes_are_timed_per_generation_while_started() -> None:
    pauses = GcPauses()
    gc.collect()
    assert pauses.collections == [0, 0, 0]  # not started: nothing counted
    pauses.start()
    pauses.start()  # once only
    try:
        gc.collect(2)
        gc.collect(0)
    finally:
        pauses.stop()
    assert pauses.collections[2] == 1 and pauses.collections[0] >= 1
    assert pauses.seconds[2] > 0 and pauses.longest >= pauses.seconds[2]
    gc.collect(2)
    assert pauses.collections[2] == 1  # stopped
    pauses.stop()  # stopping twice is harmless


def test_metrics_show_passes_and_frozen_objects() -> None:
    metrics = Metrics()
    assert "cosyvoice_gc_collections_total" not in metrics.render()  # no pass counted yet
    metrics.gc_pauses.start()
    try:
        gc.collect(2)
    finally:
        metrics.gc_pauses.stop()
    metrics.frozen_objects = 1234  # as the app sets it when it freezes
    lines = metrics.render().splitlines()
    assert 'cosyvoice_gc_collections_total{generation="2"} 1' in lines
    assert any(l.startswith('cosyvoice_gc_pause_seconds_total{generation="2"} ') for l in lines)
    assert "cosyvoice_gc_frozen_objects 1234" in lines


def test_a_scrape_does_not_walk_the_frozen_objects(monkeypatch) -> None:
    """`gc.get_freeze_count()` walks every frozen object with the GIL held (18 ms for a
    gateway's 186,000 on the CPU machine): a scrape must not call it."""
    def walk() -> int:
        raise AssertionError("a scrape walked the frozen objects")
    monkeypatch.setattr(gc, "get_freeze_count", walk)
    assert "cosyvoice_gc_frozen_objects 0" in Metrics().render().splitlines()


def test_freeze_exempts_live_objects_until_unfrozen() -> None:
    kept = [[i] for i in range(1000)]  # container objects alive now
    try:
        frozen = freeze_startup_objects()
        # Frozen objects that die leave the count (another test's server thread may drop
        # some meanwhile); none joins it without another freeze.
        assert frozen >= gc.get_freeze_count() > len(kept)
        walked = {id(o) for o in gc.get_objects()}  # what a pass would walk
        assert not any(id(x) in walked for x in kept)
    finally:
        unfreeze()
    assert gc.get_freeze_count() == 0


def test_gateway_freezes_its_start_up_and_gives_it_back_at_shutdown(tiny_model_dir: Path, tmp_path: Path) -> None:
    with live_gateway(tiny_model_dir, tmp_path) as srv, srv.client() as c:
        assert gc.get_freeze_count() > 0  # the same process: the app froze its start-up objects
        gc.collect(2)  # the collector's pass, as the server's process would run one
        m = scrape(c)
        # What the app froze at start; some of those objects may be freed since.
        assert m["cosyvoice_gc_frozen_objects"] >= gc.get_freeze_count() > 0
        assert m['cosyvoice_gc_collections_total{generation="2"}'] >= 1
        assert m['cosyvoice_gc_pause_seconds_total{generation="2"}'] > 0
    assert gc.get_freeze_count() == 0  # unfrozen at shutdown


def test_gc_pause_bench_compares_walking_everything_with_frozen_start_up(tiny_model_dir: Path) -> None:
    from bench.gc_pause import main as gc_pause

    result = gc_pause(["--model", str(tiny_model_dir), "--reps", "1"])
    walked, frozen = result["all_walked"], result["start_up_frozen"]
    assert walked["objects_walked"] > 10_000 and walked["pass_ms"] > 0  # torch, the engine, the gateway
    assert frozen["objects_walked"] < walked["objects_walked"] / 100
    assert frozen["frozen_objects"] >= walked["objects_walked"] - 100
    assert gc.get_freeze_count() == 0  # the app's shutdown gave them back
