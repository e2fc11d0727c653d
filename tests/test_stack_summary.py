"""bench.stack_summary: py-spy's raw stacks summed per thread and function."""

from __future__ import annotations

from bench.stack_summary import frame_key, main, parse, summary

RAW = """\
thread (5184): MainThread;<module> (thr.py:11);main_work (thr.py:8) 5
thread (5226): worker-1;Thread.run (threading.py:982);busy (thr.py:5) 68
thread (5184): MainThread;<module> (thr.py:11);main_work (thr.py:9) 56
thread (5184): MainThread;<module> (thr.py:11);f (x.py:2);f (x.py:3) 9
py-spy> Wrote raw flamegraph data
"""


def test_frames_of_one_function_are_summed_over_its_lines() -> None:
    assert frame_key("main_work (thr.py:8)") == frame_key("main_work (thr.py:9)") == "main_work (thr.py)"
    assert frame_key("<module> (a:b.py:11)") == "<module> (a:b.py)"  # only the trailing line number goes


def test_samples_per_thread_inclusive_and_self() -> None:
    threads = parse(RAW)
    main_thread = threads["MainThread (5184)"]
    assert main_thread.samples == 70 and threads["worker-1 (5226)"].samples == 68
    assert main_thread.inclusive["<module> (thr.py)"] == 70
    assert main_thread.inclusive["main_work (thr.py)"] == 61
    assert main_thread.inclusive["f (x.py)"] == 9  # recursion counts a stack once
    assert main_thread.self_["main_work (thr.py)"] == 61 and main_thread.self_["f (x.py)"] == 9
    assert "<module> (thr.py)" not in main_thread.self_


def test_summary_breaks_down_the_busiest_or_the_named_thread(tmp_path, capsys) -> None:
    threads = parse(RAW)
    text = summary(threads, rate=50, duration=2, top=3)
    assert "     70   70.0%  MainThread (5184)" in text and "68.0%  worker-1 (5226)" in text
    assert "MainThread (5184): top 3 functions by inclusive samples" in text
    assert " 87.1%      61  main_work (thr.py)" in text
    assert "worker-1 (5226): top 40 functions by self samples" in summary(threads, thread="worker")
    assert summary(threads, thread="nope").endswith("no thread named 'nope'")
    assert summary({}) == "no stacks"
    path = tmp_path / "stacks.txt"
    path.write_text(RAW)
    main([str(path), "--top", "1"])
    assert "busy (thr.py)" not in capsys.readouterr().out  # only MainThread's top function
