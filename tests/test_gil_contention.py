"""bench/gil_contention.py: operator calls timed alone and beside a part-busy Python thread."""

from __future__ import annotations

import json
import sys
import threading

from bench import gil_contention


def test_reports_each_switch_interval_and_duty(tmp_path) -> None:  # noqa: ANN001
    out = tmp_path / "gil.json"
    before = sys.getswitchinterval()
    report = gil_contention.main(["--ops", "200", "--reps", "2", "--duty", "0.5,1", "--period-ms", "2",
                                  "--switch-ms", "5,0.5", "--json", str(out)])
    assert [r["switch_ms"] for r in report["results"]] == [5.0, 0.5]
    for r in report["results"]:
        assert r["alone_ms"] > 0 and set(r["beside"]) == {"0.5", "1.0"}
        assert all(ms > 0 for ms in r["beside"].values())
    assert json.loads(out.read_text()) == report
    assert sys.getswitchinterval() == before  # restored
    assert not [t for t in threading.enumerate() if t.name == "busy-loop"]  # stopped


def test_a_loop_thread_runs_until_stopped() -> None:
    """Whatever its duty (always busy or half asleep), the loop ends once told to."""
    for duty in (1.0, 0.5):
        stop = threading.Event()
        thread = gil_contention.loop_thread(duty, 0.002, stop)
        thread.start()
        assert thread.is_alive()
        stop.set()
        thread.join(timeout=10)
        assert not thread.is_alive()
