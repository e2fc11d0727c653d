"""`bench.chunk_cost`: the schedule's flow frames per frame played, by arithmetic."""

from __future__ import annotations

from bench.chunk_cost import main


def test_a_segment_behind_earlier_audio_costs_less_than_half() -> None:
    out = main(["--tokens", "105,400"])
    short, long = out["results"]
    # The load benchmark's segments: 10 + 34 + 50 + an 11-token tail that re-reads 69 tokens
    # of context, each window after the 4.25-s voice's 200 cached frames padded to 50.
    assert short["awaited"]["hops"] == [10, 34, 50, 11] and short["awaited"]["frames"] == 50 + 100 + 200 + 200
    assert short["patient"]["hops"] == [105] and short["patient"]["frames"] == 250
    # A long utterance: patient chunks are max_hop (the engine's, 150) on the grid and one
    # last one that fits.
    assert long["patient"]["hops"] == [144, 150, 106]
    assert main(["--tokens", "400", "--max-hop", "100"])["results"][0]["patient"]["hops"] == [94, 100, 100, 106]
    for row in out["results"]:
        for mode in ("awaited", "patient"):
            assert sum(row[mode]["hops"]) == row["tokens"]
        assert row["patient"]["frames"] < row["awaited"]["frames"]
