"""What the chunk schedule alone makes the flow compute, per frame of audio.

    python -m bench.chunk_cost [--prompt-tokens 106] [--tokens 25,50,105,200,400] [--json out.json]

Arithmetic, no model: one utterance of N speech tokens cut into chunks two ways, each
chunk's flow window after the voice's cached prompt (`chunking.chunk_frames`) padded to the
flow graphs' frame buckets (`GraphPolicy.padded_frames`), summed and divided by the 2N
frames the utterance plays:

    awaited   the schedule as an opening utterance gets it: `initial_hop`, up to the grid,
              then doubling hops to `max_hop`, each cut as soon as its tokens (and their
              lookahead) exist; the rest as the last chunk.
    patient   as `engine.chunk_patience_s` cuts a chunk that is not due soon, the LM done
              by the time it goes (a later segment behind earlier audio):
              `chunking.patient_target`.

Row padding (batches padded to their graph's row bucket) and the batch a chunk shares are left out:
they depend on the load. The 4.25-s voice of the load benchmark has 106 prompt tokens.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

from engine.chunking import ChunkSchedule, chunk_frames, patient_target
from engine.config import EngineConfig
from engine.flow_graphs import GraphPolicy
from engine.flow_prompt_cache import cacheable_frames

RATIO = 2  # mel frames per speech token (CosyVoice2 and 3)
LOOKAHEAD = 3  # CosyVoice3's pre-lookahead tokens
BLOCK = 50  # the DiT's attention block in frames


@dataclass(frozen=True)
class Cut:
    offset: int
    hop: int
    final: bool
    frames: int  # the chunk's flow window after the cached prompt, padded


def awaited_cuts(tokens: int, prompt_tokens: int, initial_hop: int, max_hop: int) -> list[tuple[int, int, bool]]:
    """(offset, hop, final) of each chunk, each cut as soon as its tokens and lookahead exist."""
    sched = ChunkSchedule(prompt_tokens=prompt_tokens, initial_hop=initial_hop, max_hop=max_hop, lookahead=LOOKAHEAD)
    cuts = []
    while sched.offset < tokens:
        hop = sched.ready(tokens)
        if hop is None:  # not enough left for the next hop and its lookahead: the rest
            cuts.append((sched.offset, tokens - sched.offset, True))
            break
        cuts.append((sched.offset, hop, False))
        sched.advance(hop)
    return cuts


def patient_cuts(tokens: int, prompt_tokens: int, max_hop: int, left_context: int) -> list[tuple[int, int, bool]]:
    """(offset, hop, final) of each chunk `patient_target` cuts with the LM done."""
    cuts, offset = [], 0
    while offset < tokens:
        end, final, _ = patient_target(prompt_tokens, offset, tokens, True, LOOKAHEAD, max_hop, left_context)
        cuts.append((offset, end - offset, final))
        offset = end
    return cuts


def priced(cuts: list[tuple[int, int, bool]], prompt_tokens: int, left_context: int,
           policy: GraphPolicy) -> list[Cut]:
    cached = cacheable_frames(prompt_tokens, RATIO, LOOKAHEAD, BLOCK)
    out = []
    for offset, hop, final in cuts:
        window = chunk_frames(prompt_tokens, offset, hop, left_context, RATIO, cached)
        padded = policy.padded_frames(window)
        out.append(Cut(offset, hop, final, window if padded is None else padded))
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=106)
    ap.add_argument("--tokens", default="25,50,105,200,400", help="utterance lengths in speech tokens")
    ap.add_argument("--initial-hop", type=int, default=10)
    ap.add_argument("--max-hop", type=int, default=EngineConfig.max_hop, help="default: the engine's")
    ap.add_argument("--left-context", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    policy, rows = GraphPolicy(), []
    for n in (int(x) for x in args.tokens.split(",")):
        row: dict[str, Any] = {"tokens": n}
        for mode, cuts in (("awaited", awaited_cuts(n, args.prompt_tokens, args.initial_hop, args.max_hop)),
                           ("patient", patient_cuts(n, args.prompt_tokens, args.max_hop, args.left_context))):
            chunks = priced(cuts, args.prompt_tokens, args.left_context, policy)
            frames = sum(c.frames for c in chunks)
            row[mode] = {"hops": [c.hop for c in chunks], "frames": frames, "per_frame_played": frames / (RATIO * n)}
        rows.append(row)
        print(f"{n:4d} tokens: awaited {row['awaited']['hops']} -> {row['awaited']['frames']} frames "
              f"({row['awaited']['per_frame_played']:.2f}x); patient {row['patient']['hops']} -> "
              f"{row['patient']['frames']} ({row['patient']['per_frame_played']:.2f}x)")
    out = {"prompt_tokens": args.prompt_tokens, "initial_hop": args.initial_hop, "max_hop": args.max_hop,
           "left_context": args.left_context, "results": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
