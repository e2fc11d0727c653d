"""Runtime options of the engine (what to load, where, and how to stream).

Model hyper-parameters live in `engine.models.config`; these are the knobs an operator
turns. The gateway's `Settings` embeds one of these, so every option has one typed home.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

import torch

from .chunking import GRID
from .first_chunk import OpeningRate
from .mps import MPSPriority

# The flow graphs' row buckets by default (`flow_graph_rows`, `GraphPolicy.batch_buckets`).
# Every count up to 6, since under load the stage's rounds hold 3-6 chunks (round 48 of
# docs/benchmarks.md): powers of two alone ran 5 chunks as 8 rows, and on an H100 the stage
# alone took 58.3 ms a round of 5 chunks against 44.6 at 5 rows (38.3 against 31.8 at 3).
GRAPH_ROW_BUCKETS: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8, 12, 16, 32, 64)

LMBackendName = Literal["auto", "torch", "vllm"]
StagePolicy = Literal["first_chunks", "deadline"]
# A later chunk is due this long before the audio already sent runs out at the client:
# room for the batch's own compute, the network and the client's jitter buffer.
DEADLINE_MARGIN_S = 0.25
# The most `stage_pipeline_lead_ms` (and its knob) may be: a round takes tens of ms.
MAX_PIPELINE_LEAD_MS = 1000.0
# The most `first_chunk_hold_ms` (and its knob `hold_ms`) may be.
MAX_FIRST_CHUNK_HOLD_MS = 1000.0
FlowDType = Literal["auto", "float32", "bfloat16", "float16"]
FlowAttention = Literal["sdpa", "cudnn", "triton"]  # engine.models.dit.ATTENTION_KERNELS
FlowConvKernel = Literal["triton", "torch"]  # engine.models.dit.CONV_KERNELS
SnakeKernelName = Literal["triton", "torch"]  # engine.models.hift.SNAKE_KERNELS
# vLLM's `CompilationConfig.cudagraph_mode` values, lower-case (`vllm_cudagraph_mode`).
VLLMGraphMode = Literal["full", "full_and_piecewise", "piecewise", "full_decode_only", "none"]
DEFAULT_VLLM_GRAPH_MODE: VLLMGraphMode = "full"


@dataclass(frozen=True)
class EngineConfig:
    model_dir: Path
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    lm_backend: LMBackendName = "auto"  # auto = vllm on CUDA when importable, else torch
    # Chunk schedule in speech tokens (25 tokens = 1 s of audio).
    # First chunk after this many tokens (+ lookahead); 0 = official 25-grid start. 10: on
    # the H200 with sessions arriving over 16 s (rounds 22-23 of docs/benchmarks.md), every
    # level with 6 had sessions run dry at their second chunk (1-9 of 32-64), one session
    # had too (rounds 21-22), and no level of 32-128 sessions with 10 had one (rounds
    # 22-24). It costs one session ~4 LM steps of first audio: 85 ms in round 24, 74 with 6.
    initial_hop: int = 10
    # ... and this many when nothing else is on the engine as the first chunk is sized (no
    # other utterance decoding or on the stage: a lone session's first chunk rides a
    # one-row round, ~25 ms on the H200, and its next chunk one like it). 6 tokens play
    # 80 ms after the vocoder's holdback (0.16 s), enough for the next chunk's tokens and
    # round at the 2.5-2.9 ms a token and 25-27 ms lone rounds measured since round 32; the
    # planner raises it when its timeline predicts a stall (with a 106-token prompt it
    # keeps 6; a 120-token one, whose next chunk is 24 tokens, gets 7). H200, round 37 of
    # docs/benchmarks.md: lone first audio median 56 ms over 13 levels with 6 against 61 with
    # 8 or 7 (three levels each, alternating on one gateway), none dry. Rounds 21-22 ran
    # 6-token first chunks dry with 100-113-ms lone rounds, before the stage was 4x faster.
    # 0, or >= initial_hop: initial_hop alone. Only with the planner on (initial_hop_max >
    # initial_hop): fixed chunks stay fixed.
    idle_initial_hop: int = 6
    # The first chunk takes more tokens, up to this many, when the load predicts that the
    # audio would run out before a later chunk arrives (`engine.first_chunk`: from the LM's
    # rate and the audio stage's round times, both measured). <= initial_hop, or
    # initial_hop 0: fixed. A request that sets its own initial_hop gets it as asked.
    initial_hop_max: int = 40
    # The planner may take fewer tokens than the floor (initial_hop, or idle_initial_hop
    # alone), down to this many, when its timeline predicts at least as much time to spare
    # as for the hop it would take (`engine.first_chunk.shortest_as_safe`: the chunk after
    # the first ends on the 25-token grid, and a shorter first chunk can make it much
    # shorter). 0: never below the floor. 8: on the H200 (round 28) it ran none dry at 64
    # sessions arriving over 16 s, but doubled bursts' first audio without the limit below;
    # with it (round 30, levels alternating with 0 on one gateway) 64 sessions over 16 s had
    # p95 125-157 ms against 153-176 and bursts 461-524 against 471-729, none dry over 16 s
    # and one burst of three dry either way.
    first_chunk_min_hop: int = 8
    # ... and only while fewer than this many other utterances wait for their first chunk:
    # first chunks sized at once share an opening round, which one utterance's timeline
    # does not see (`FirstChunkPlanner.min_hop_crowd`: on the H200 in round 28 of
    # docs/benchmarks.md, 64-session bursts' first audio doubled with the option and no such
    # limit). 4: a burst has tens. Round 29 ran it when the count took in a session's next
    # utterances, whose first chunks wait behind its playing audio: the gate then stayed shut
    # for 58-61 of 64 sessions arriving over 16 s. Only awaited first chunks count now
    # (`Session._first_chunk_awaited`): in round 30 it let 62-63 of 64 such decisions go
    # below the floor, and none in bursts.
    first_chunk_min_hop_crowd: int = 4
    # The planned first chunk's predicted arrival times keep this fraction to spare. 0.5:
    # in an H200 burst of round 15 (docs/benchmarks.md) the opening round ran 1.9x its
    # prediction (the LM decoding beside it slows it; the planner learnt that size at
    # other moments), and a token more of first chunk costs ~7 ms of first audio at 64
    # sessions while it buys 40 ms of audio to play.
    first_chunk_margin: float = 0.5
    # The LM rate a session's first utterance is sized on: "slower" (of its own and the one
    # learnt for as many decoding) or "learnt" (that one alone, where there is one):
    # `engine.first_chunk.FirstChunkPlanner.opening_rate` says why. Not yet measured.
    first_chunk_opening_rate: OpeningRate = "slower"
    # Plan a later chunk's round no shorter than second chunks took lately with as many
    # utterances on the stage (`engine.first_chunk.SecondRounds` says why: under arrivals
    # spread over time a second chunk waits for the round in progress and rides with
    # other utterances' long chunks). Off: the round estimate alone, as up to round 21.
    first_chunk_second_rounds: bool = True
    # The round estimate that sizes first chunks counts the utterances in progress, each
    # with a chunk in the same round, which is what a burst brings. On: less those whose
    # latest chunk was cut big because its audio was not due soon (chunk_patience_s): under
    # arrivals spread over time they are most of those in progress and queue few chunks.
    # On an H100 at 224 sessions over 16 s (round 40 of docs/benchmarks.md) ~70 were in
    # progress, past the stage's 64 rows, so the estimate doubled: rounds of 620 ms were
    # planned, first chunks of 29-30 tokens, where first chunks' rounds took 229 ms. On in
    # round 41 (224 sessions, two runs each way): first chunks of 20-21 tokens, p95 977 and
    # 1,009 ms against 1,126 and 1,066; with `stage_first_chunk_cut` too, 735 and 792 against
    # 857 and 828 but 9 and 15 sessions dry at their second chunk. Off until that is solved.
    first_chunk_skip_patient: bool = False
    # The same estimate with the utterances waiting patiently still in each round's width
    # (their big chunks ride in rounds and a later chunk is padded to them) but not in how
    # many rounds the crowd fills: the whole-crowd estimate doubles past the stage's 64 rows
    # (ceil(live / max_gpu_batch) rounds), as if every utterance queued a chunk each round,
    # where a patient one queues one in several. A burst has no patient utterances and keeps
    # the whole-crowd estimate. On one H100 at 272 sessions over 16 s under MPS (round 55 of
    # docs/benchmarks.md, the stage below normal): sessions' opening decisions planned first
    # rounds of 135-164 ms on average against 427-467 without it, first chunks were 15.6-17.4
    # tokens against 25.1-28.8, and first audio p95 was 362-487 ms in four levels against
    # 581 and 770 in two. Without it more utterances were on the stage at a decision (67-75
    # on average against 55-66), past the 64 where the whole-crowd estimate doubles. At
    # 288-304 sessions, where neither met 500 ms, it was not consistently better (p95 1,006 ms
    # with 11 sessions dry against 754 at 288, 1,178 against 1,268 at 304).
    first_chunk_due_rounds: bool = True
    # A chunk's deadline (and its patience, chunk_patience_s) counts the audio its
    # utterance's chunks still on the stage will deliver, and a first chunk delivers its
    # tokens' worth less what the vocoder keeps back (the planner's learnt `holdback_s`,
    # 160 ms): a second chunk after an 8-token first chunk is due 160 ms after that chunk
    # arrives, not 320 (`FirstChunkPlanner.audio_in_flight`). Off: the tokens' worth,
    # as up to round 41, where on an H100 at 176-208 sessions over 16 s (round 42 of
    # docs/benchmarks.md) the sessions that ran dry did so at their second chunk after
    # waiting 116-454 ms for the stage, against 66-74 on average: it took them for 160 ms
    # less urgent than they were.
    first_chunk_deadline_holdback: bool = True
    # While fewer than this many other utterances' listeners wait for a first chunk, the
    # first-chunk planner takes no round as longer than the longest second chunks took
    # lately with as many utterances on the stage (`FirstChunkPlanner.learnt_rounds_crowd`):
    # the round estimate above is a burst's. On an H100 at 200 sessions over 16 s (round 43
    # of docs/benchmarks.md) it planned 558-610-ms rounds where the second chunks' learnt
    # rounds were 42-241 ms, and first chunks were 24-28 tokens long (p95 707-755 ms).
    # Measured in round 44 (H100, 200 and 208 sessions over 16 s, levels alternating on
    # one gateway): with 16, first chunks of 19-20 tokens against 26-28 and first audio's
    # p50 65-77 ms lower, but p95 only 11-67 ms lower and 2-8 sessions dry in every run
    # against none: the long first chunks covered second chunks that the saturated stage
    # (96% busy) brought late. 0: off.
    first_chunk_learnt_rounds_crowd: int = 0
    # A stage round about to start first chunks waits up to this long for the first chunks
    # the engine expects within it (from each one's tokens still to come and its LM rate):
    # in a burst they come ready over a few LM steps, and one that misses the round waits
    # a whole round more. On the H200 (round 16 of docs/benchmarks.md) a 40-session burst
    # without it opened with a 1-row round and that session ran dry; with 25 ms, two
    # 40-session bursts held 3 and 6 ms and 25 and 39 first chunks joined. 0: no wait.
    first_chunk_hold_ms: float = 25.0
    # The hold grows to this share of the round an expected first chunk would miss (the
    # full-burst round the engine predicts for it): waiting w ms delays the queued rows by w
    # and saves each chunk it catches a whole round. In round 17 of docs/benchmarks.md a
    # 40-session burst held 5 ms, caught 19 first chunks and left 10 for a later round
    # (p95 857 against 474 ms in the level before it); its rounds were predicted at 434 ms.
    # 0: the fixed hold alone. Round 21: 0.15 put every first chunk of two 64-session bursts
    # in one round (0 passed over, against 63 and 27), and the third ran 34 sessions dry.
    first_chunk_hold_share: float = 0.0
    # A planned first chunk is announced to the hold once more halfway to its tokens, from
    # the LM's rate then. The first announcement's rate comes from the later half of the
    # utterance's token times so far, and in a burst those steps share the GPU with the
    # others' prefills: in round 56 of docs/benchmarks.md (one H100, bursts of 64) one
    # burst's first chunks came 73 ms sooner than announced on average, no round waited for
    # them (announced past the 25-ms hold), and they went in a second round. After another
    # machine start, with this and an 80-ms hold, four bursts of four put all 64 first
    # chunks in one round (p95 229-242 ms) against two of four with neither (p95 241, 241,
    # 309, 477); which of the two did it is unmeasured. Over time the pair lost (round 57:
    # 288 sessions over 16 s at p95 764 and 774 ms against 516 and 476). Off: one announcement.
    first_chunk_hold_refresh: bool = False
    # The hold is this long (ms) while a burst is under way: when at least
    # `first_chunk_burst_rows` urgent first chunks (their listeners waiting) are queued or
    # expected within it, and then for those alone. Round 57 of docs/benchmarks.md: an
    # 80-ms hold (with the refresh above) put bursts of 64 in one round, and lost at 288
    # sessions over 16 s. Round 58 (one H100): counting every expected first chunk, later
    # segments' too, 80 ms with 8 or 16 rows put bursts of 64 at p95 380, 420, 801, 498 ms
    # against 611, 549, 636, 681, and counted most of its held rounds at 288 over 16 s as
    # bursts (p95 1141-1376 against 669-895); urgent ones alone are unmeasured. 0: off.
    first_chunk_burst_hold_ms: float = 0.0
    first_chunk_burst_rows: int = 8
    # The largest chunk, in speech tokens (25 a second, on the 25-token grid): what a patient
    # chunk (chunk_patience_s) is cut to. Each chunk re-reads up to 74 tokens of left context
    # (flow_left_context), so larger patient chunks compute fewer frames for the same audio.
    # On an H100 (round 52 of docs/benchmarks.md) 150 against 100 at 256 sessions over 16 s:
    # 1.46 flow frames computed per frame played against 1.71-1.75, and first audio p95
    # 327-339 ms against 543-577 (four levels each, either order); 200 gave no more (its
    # chunks were no larger: at 150 a segment's last chunk already takes up to 227 tokens).
    max_hop: int = 150
    # A chunk whose audio is due more than this many seconds from now (a later segment
    # behind seconds of audio still to play, or a long utterance well ahead of its
    # listener) waits for more tokens and is cut as large as a chunk may be: max_hop
    # tokens on the 25-token grid, or the utterance's rest once its LM is done
    # (`engine.chunking.patient_target`). A 105-token segment behind earlier audio is then
    # one chunk instead of four (10 + 34 + 50 + an 11-token tail that re-reads 69 tokens
    # of context): fewer flow calls and less re-read context for the same audio. Its first audio
    # comes later, when it is not awaited. Chunk boundaries then depend on timing, like
    # the first-chunk planner's; a request that sets its own initial_hop or max_hop keeps
    # its schedule. 0 = off. On the H200 (round 25) 1.0 took 112 sessions arriving over
    # 16 s from first audio p95 1308 to 277 ms, none dry either way.
    chunk_patience_s: float = 1.0
    # A session's later utterances make no more audio while this many seconds of its audio
    # wait for its consumer (a socket whose queue is full, an HTTP client reading slowly);
    # the utterance being delivered goes on. Without it every segment's audio was made and
    # held, the whole text's worth, however slowly the client read. 0 = no limit.
    max_unread_audio_s: float = 30.0
    # Earlier speech tokens the flow re-reads as left context per chunk, rounded down
    # to whole 25-token blocks; bounds per-chunk cost. -1 = unbounded (exact, O(n) per chunk).
    flow_left_context: int = 50
    # Decode an utterance's last chunk with full attention (the flow's streaming=False), as
    # the official streaming inference does (`CosyVoice2Model.tts` passes no `stream` to its
    # final `token2wav`). Off: every chunk is block-causal, so the last one shares the prompt
    # cache, the CUDA graphs and its batch's flow call with the others. On: last chunks run
    # in a flow call of their own, eagerly, without the caches. With flow_left_context -1,
    # initial_hop 0 and chunk_patience_s 0 (the official chunk boundaries) the audio then
    # matches the official streaming output (README, "Fidelity to the official inference").
    flow_final_full_attention: bool = False
    max_gpu_batch: int = 64  # chunks per flow/vocoder batch
    # Precision of the flow (weights and activations; its ODE state stays float32).
    # auto = bfloat16 on CUDA, float32 on CPU.
    flow_dtype: FlowDType = "auto"
    # torch.compile the CosyVoice3 flow's DiT blocks (fuses their elementwise passes;
    # 1.4x at 64 chunks on the H200; compiles once per stage at start). CUDA only; CPU
    # ignores it (compiling there costs more than it saves in tests).
    flow_compile: bool = True
    # The CosyVoice3 DiT's attention kernel: "cudnn" (cuDNN's fused attention, called
    # directly) or "sdpa" (PyTorch's pick). Batches split at their prompt
    # (`flow_split_prefix_rows`) need each part's log-sum-exp, which SDPA's own dispatch
    # cannot return, so there "sdpa" means the memory-efficient kernel: on the stage alone
    # (round 38 of docs/benchmarks.md) rounds of 16 and 64 chunks took 11-12% longer with
    # it, as accurate as cuDNN's against float64; smaller rounds run cuDNN either way. A
    # GPU where cuDNN's kernel does not run gets "sdpa" (`dit.attention_kernel_for`).
    # "triton" (the default): "cudnn", but a split batch's two attentions and their merge
    # are one kernel (`engine.models.split_attention_kernel`). On H100s (round 45) the stage
    # alone took 3.5-5% less time a round of 5-8 chunks and 1-2% at 16, as close to float64
    # as cuDNN's; 192-200 sessions arriving over 16 s had first audio p95 525-642 ms (four
    # runs at 192, median 560) against 638-710 (median 662), and 597-604 against 685-734 at
    # 200. Where it cannot run (no Triton; a trial call at start fails) it is "cudnn".
    flow_attention: FlowAttention = "triton"
    # With "triton" (ignored with the others): the rotary embedding turns head 0 alone, so
    # the split kernel takes that head's queries and own keys rotated, apart, and the other
    # heads straight from the q/k/v projection (`SplitMasks.rotary`), instead of a rotated
    # copy of all of q and k. That copy was 7.2% of a ~5-chunk round's GPU time on an H100
    # (round 45: 4.07 ms of 56.7); without it (round 46, H100) the stage alone took 6.5-6.8%
    # less time a round of 5-8 chunks and 5.6% at 16, with the same PCM to the bit. Only in
    # calls with no ring of context keys and none kept (with the flow context cache on, the
    # one-voice graphs carry both and rotate as before). Where the kernel's trial with it
    # fails, the stage logs a warning and rotates as before.
    flow_attention_rotary: bool = True
    # The CosyVoice3 DiT's position convolutions (kernel 31, 16 groups, Mish after):
    # "triton" (`engine.models.causal_conv_kernel`: one kernel on the frame-major
    # activations, CUDA with Triton; elsewhere as "torch") or "torch" (a batched product
    # over the taps for small inputs, cuDNN above). cuDNN ran it as one kernel per group
    # plus layout conversions: ~24% of a 64-chunk opening round's kernel time on an H100.
    # The stage alone there (round 38 of docs/benchmarks.md) took 13-19% less time a round
    # with "triton" from 4 chunks on, 3% at one.
    flow_conv_kernel: FlowConvKernel = "triton"
    # The CosyVoice3/CosyVoice2 vocoder's Snake activations (~70 a decode): "triton" (one
    # fused pass each, `engine.models.snake_kernel`; CUDA with Triton, elsewhere as
    # "torch") or "torch" (four or five eager elementwise passes over a float32 tensor).
    # On an H100 (round 39 of docs/benchmarks.md) the vocoder's GPU time fell 19-30% with
    # "triton", and the stage's rounds of 1-64 chunks took 5-7% less time.
    vocoder_snake_kernel: SnakeKernelName = "triton"
    # The CosyVoice3 vocoder's decode with its activations channels-last ([B, C, 1, T],
    # frame-major storage) and every convolution a channels-last 2-D one
    # (`CausalHiFTGenerator.channels_last`), instead of channels-first 1-D ones, around which
    # cuDNN's TF32 kernels convert the layout of each convolution's input, weight and output;
    # its Snakes also add the bias and pad for the convolutions around them. The same audio
    # up to the convolutions' rounding (stage PCM relative RMS difference 4.2e-4). On an
    # H100 (round 47 of docs/benchmarks.md) the vocoder's GPU time fell 33-34% at 5-64
    # streams, and the stage's rounds of 5-16 chunks took 5.9-6.4% less time.
    # CosyVoice2's vocoder stays channels-first.
    vocoder_channels_last: bool = True
    # A batch of at least this many chunks, all of one voice, attends to the voice's cached
    # prompt once per CFG half, all rows' queries together, and to each row's own frames
    # apart, merging the two by their log-sum-exps (`engine.models.dit.split_prefix_attention`),
    # instead of over per-row copies of the prompt's keys and values. Exact up to rounding.
    # On the H200 (round 17 of docs/benchmarks.md, the stage alone) a 64-chunk opening round
    # took 129 against 142 ms, but one chunk 24.0 against 21.4 ms with cuDNN's two calls and a
    # merge. With the one-kernel split attention (`flow_attention` "triton") it pays at small
    # sizes too: on an H100 (round 48) rounds of 1, 3, 5 and 6 chunks took 20.2, 28.5, 40.8
    # and 44.4 ms against 21.9, 31.9, 45.1 and 48.8 from 8 (4 chunks the same). None: 1 where the DiT's attention is
    # the split kernel, 8 with cuDNN's or SDPA's (the CPU's), `dit.split_prefix_rows_for`.
    # 0: never.
    flow_split_prefix_rows: int | None = None
    # CUDA graphs for the CosyVoice3 flow's ODE solve (CUDA only; CPU ignores it).
    flow_cuda_graphs: bool = True
    # Batches with more chunks than this skip the graphs and run eagerly at their exact
    # row count (graphs pad rows to their bucket; above 16 rows a batch takes its bucket
    # only when it fills half of it, `GraphPolicy.min_fill`). 64 = the largest graph bucket.
    # With the prompt cache, batches served from it take graphs only up to
    # GraphPolicy.prefix_max_rows (8) chunks, or flow_graph_shared_rows.
    flow_graph_max_rows: int = 64
    # The row buckets of those graphs: a batch is padded to the smallest that holds it
    # (`GraphPolicy.batch_buckets`; each is captured for every voice prompt width). A
    # bucket between 32 and 64 (48, say) would solve 33-48 chunks at 3/4 of the 64-row
    # cost, for more captures at start and registration (not measured).
    flow_graph_rows: tuple[int, ...] = GRAPH_ROW_BUCKETS
    # Frame sizes that get graphs besides every multiple of 50 (`GraphPolicy.frame_buckets`),
    # e.g. 60,70,80 for first chunks of 20-34 tokens, which pad to 100 frames otherwise.
    # Empty by default: not yet measured on a GPU, and each costs captures at start.
    flow_graph_frames: tuple[int, ...] = ()
    # With the prompt cache, a batch whose chunks all have one voice takes a graph when its
    # row bucket (1, 2, 3, ..., 64) is at most this (the voice's prefix is held once, not per
    # row: `PrefixViews.shared`); otherwise the per-row prefix graphs (up to 8) or eager.
    # 64: in 64-session bursts on the H200 (round 9, two each) the first chunks' stage
    # phase took 431-482 ms against 455-521 ms with 16; a full batch's shapes are then
    # captured when the voice is registered instead of met first in the load.
    flow_graph_shared_rows: int = 64
    # At most this many flow graphs kept per stage (`GraphPolicy.max_graphs`; the least
    # recently used go first, and a batch whose graph went captures it again while serving,
    # 0.5-0.8 s a round on the H200). The voices of a prompt width (100, 200 or 300 cached
    # frames) warm at most 187 graphs of their own at the default row buckets and max_hop (11
    # one-voice and 6 per-row prefix ones, up to 8 rows, at each of up to 11 frame buckets of
    # 50; 153 at round 51's max_hop of 100, 9 buckets); 600 holds all three widths'
    # (561). They share one memory pool; beyond it each graph held ~13 MiB of device memory
    # on the H200 (round 37 of docs/benchmarks.md: a second width's 80 graphs took 1,054
    # MiB), so all three widths' graphs take ~7.1 GiB.
    flow_graph_limit: int = 600
    # CUDA graphs for the CosyVoice3 vocoder's decode up to 8 streams (`engine.vocoder_graphs`;
    # launch-bound there). CUDA only; CPU ignores it.
    vocoder_cuda_graphs: bool = True
    # Their row (stream) buckets (`VocoderGraphPolicy.batch_buckets`). Up to 8: alone, larger
    # batches are compute-bound. Beside a busy event loop every operator the vocoder
    # launches eagerly can wait for the interpreter (a 64-stream step dispatches ~2700, its
    # decode ~620 of them; round 17 of docs/benchmarks.md): 16-64 make that decode one
    # replay, for more captures at start and larger static buffers. Not yet measured.
    vocoder_graph_rows: tuple[int, ...] = (1, 2, 4, 8)
    # Cache each voice prompt's DiT keys/values (`engine.flow_prompt_cache`) so every flow
    # batch computes only the frames after the prompt's cached blocks (CUDA graphs up to
    # GraphPolicy.prefix_max_rows chunks, or flow_graph_shared_rows for one voice; eager
    # above). Exact; CosyVoice3 only.
    flow_prompt_cache: bool = True
    flow_prompt_cache_bytes: int = 4 << 30  # per stage (GPU); least recently used voices go first
    # Keep each utterance's final flow frames as DiT keys/values (`engine.flow_context_cache`)
    # so that its next chunk computes only its new frames, attending to the cached prompt
    # and the last 2 x flow_left_context frames it kept, at absolute positions: a sliding
    # window over the official whole-prefix decode (exact when the window covers the
    # utterance), not the recomputed window's arithmetic, so the audio changes slightly.
    # Bytes of its pool per stage (~180 MB per utterance at full size in bf16 with the
    # default left context); 0 = off. Needs the prompt cache; CosyVoice3 only. It runs in
    # eager calls and one-voice graphs; a batch mixing voices below flow_context_min_rows
    # chunks (a per-row prefix graph) runs without it and ends its utterances' use of it.
    flow_context_cache_bytes: int = 0
    flow_context_min_rows: int = 16
    # Run a flow batch whose chunks differ much in length as up to three calls of similar
    # lengths (`engine.token2wav.split_by_length`): under staggered arrivals a batch mixes
    # first chunks (~50 frames) with later ones (~300) and a single call pads every row to
    # the longest. On the H200 with 64 sessions arriving over 16 s (round 23 of
    # docs/benchmarks.md) the stage computed 3.9x the frames played against 5.8x, and
    # first audio p95 was 396 ms against 857 (RTF 0.21 against 0.30). A burst's batches,
    # of chunks of one length, stay one call. (Round 7, before graphs and the stage's
    # own process, found fewer padded frames but no less stage time.)
    flow_split_batches: bool = True
    # What one more flow call costs there, in row-frames of ODE work
    # (`engine.token2wav.SPLIT_CALL_COST`: lower splits more often, for less padding).
    flow_split_call_cost: int = 730
    # With flow graphs, price each candidate call at its graph bucket's padded shape (rows
    # to the next row bucket, frames to the next multiple of 50) rather than its exact one
    # (`engine.token2wav.call_work`): 33 rows of one length then run as 32 + 1, not padded
    # to 64, and a split that only moves padding around is not taken. H200, sessions
    # arriving over 16 s (round 24 of docs/benchmarks.md): flow frames computed per frame
    # played 2.9-3.2x against 3.8-4.1x; 80 sessions at first audio p95 403 ms against 875.
    flow_split_padded: bool = True
    # A queued chunk shorter than the longest in its batch (its flow call, with split
    # batches) takes more of its utterance's already generated tokens, up to the length the
    # batch pads it to anyway, and at most max_hop tokens (whole 25-token blocks, or the
    # rest once the LM is done; `AudioStage._fill_padding`): the same flow work delivers
    # more audio (the vocoder decodes it), and the utterance needs fewer chunks, each of
    # which recomputes its left context. Under staggered arrivals (H200, round 7, sessions
    # spread over 5 s) batches computed 254-314 frames a chunk against 127-137 in a burst.
    # A stage in its own process grows a chunk into the tokens generated when it was
    # queued (`engine.stage_process.grow_from_spare`). Off by default: not measured on the
    # GPU yet.
    flow_fill_padding: bool = False
    # How the audio stage picks each batch from the queued chunks:
    # "first_chunks": first chunks heard after silence first (not those of an utterance
    # queued behind its session's audio still playing), then FIFO, up to max_gpu_batch;
    # "deadline": most urgent playback deadline first, grouped by similar window length
    # (less padding); see `engine.token2wav.deadline_batch`.
    stage_policy: StagePolicy = "first_chunks"
    # "deadline" only: a batch's longest flow window at most (1 + this) x its shortest.
    # Larger values give earliest-deadline-first batches of any mix of lengths (with
    # flow_fill_padding, the short rows then use the padding instead of waiting).
    stage_window_tolerance: float = 0.25
    # Either policy: a row due before its whole round would end (a session whose first
    # chunk went alone in a burst, with only that chunk's audio ahead of the 64-row round
    # of everyone's second chunks) runs first in a smaller round, and the rows with time
    # to spare in the next, when that leaves fewer rows late (`engine.token2wav.deadline_cut`).
    stage_deadline_cut: bool = True
    # ... counting a row late when its round would end less than this before its audio
    # runs out at the client. The default is the deadlines' own margin (the engine's
    # DEADLINE_MARGIN_S, which also leaves room for the round itself): a second chunk behind
    # a first chunk of less audio than that (10 tokens make 240 ms) is then late before any
    # round, and the cut does not see it (round 26 of docs/benchmarks.md).
    stage_deadline_cut_margin_ms: float = 250.0
    # ... and a row (after its utterance's first chunk) already past that deadline when the
    # cut is planned is judged by when its audio runs out instead (the margin dropped), not
    # given up: behind a first chunk of less audio than the margin every second chunk is
    # past it before its first round, and in round 49 (H100, 176 and 216 sessions over 16 s)
    # the second chunks that ran their listeners dry, by 1-2 ms, rode 7-8-row rounds of
    # 162 ms. Such a row is judged without the margin the rows not yet past it keep, so one
    # about to run out can look less urgent than one with a little more time. Off: in round
    # 50 (H100, 10 pairs of levels at 200-248 sessions over 16 s, `rescue` of
    # `POST /debug/planner`) the runs could not tell it from off; one level in 20 had
    # sessions dry (2), with it on.
    stage_deadline_cut_rescue: bool = False
    # Pipelined rounds: the next round is taken, its inputs built and its kernels queued,
    # up to this many ms before the running round is predicted to end on the device, instead
    # of once its audio is on the host; its audio then comes back by an asynchronous copy.
    # The GPU idled 5.3-7.3 ms of each 1-6-chunk round (round 48 of docs/benchmarks.md), ~2.5
    # of it the host building the flow's inputs (round 37). A chunk queued after the early
    # take waits for the round after. In round 51 (H100, 224 and 232 sessions over 16 s, four
    # pairs of levels on two gateways) a lead of 5 ms lowered first audio's p95 by 59-182 ms
    # in every pair. 0: off; `pipeline_lead_ms` of `POST /debug/planner`.
    stage_pipeline_lead_ms: float = 5.0
    # A round that carries first chunks listeners wait for in silence runs them first, with
    # the rows that would be late after them (by stage_deadline_cut_margin_ms, as the
    # deadline cut counts late, whether that one is on or not), and the rest in the next
    # round, when the first chunks gain more than the stage loses
    # (`engine.token2wav.first_chunk_cut`). On an H100 (round 41 of docs/benchmarks.md,
    # levels alternating on one gateway) first chunks' rounds went from 129 to 41-54 ms at
    # 192 sessions over 16 s, p95 437 and 394 ms against 506 and 527 (one session dry), and
    # 857 and 828 against 1,126 and 1,066 at 224; the flow computed 0-7% fewer frames (less
    # padding). Bursts of 64 never cut (every row a first chunk).
    stage_first_chunk_cut: bool = True
    # ... and an utterance's second chunk (unless patient) goes with the first chunks
    # (`AudioStage._cut_for_first_chunks`): on an H100 at 200-208 sessions over 16 s (round
    # 42 of docs/benchmarks.md) second chunks took 185-224 ms from their turn to their
    # audio, riding rounds of long chunks, and the planner sized first chunks (18-23
    # tokens, 130-182 ms of LM decode) to cover that. Measured (rounds 43 and 44): their
    # stage phase halves (67-98 ms to 35-48), first audio does not improve, and with
    # `first_chunk_learnt_rounds_crowd` 16 it ran 13-15 sessions dry a run at 200-208
    # sessions over 16 s against 2-8 without it. Off.
    stage_second_chunk_cut: bool = False
    # Profile the audio stage while it serves (`engine.stage_profile`):
    # stage_profile_batches batches of each stage under torch.profiler, from the first one at
    # index stage_profile_start or later with at least stage_profile_min_chunks chunks,
    # written to this directory (one subdirectory per stage). Empty = off. The index counts
    # from the first batch after the engine's start: its warm-up's batches come before 0.
    # A profiled stage never pipelines its rounds (stage_pipeline_lead_ms), in or out of the
    # window: what it measures is the unpipelined stage.
    stage_profile_dir: str = ""
    stage_profile_start: int = 20
    stage_profile_batches: int = 20
    stage_profile_min_chunks: int = 0
    # Extra GPUs for the flow+vocoder stage (its bottleneck): one stage copy per device,
    # the LM stays on `device`. Empty = one stage on `device`.
    stage_devices: tuple[str, ...] = ()
    # Run the audio stage in a process of its own (`engine.stage_process`), so that its
    # thousands of operator calls a round do not queue for the interpreter lock behind the
    # event loop (the WebSockets, the LM's outputs, the chunk planning). On the H200 a
    # 64-chunk round took 128 ms alone and 479 ms beside one thread running Python 90% of
    # the time (round 18 of docs/benchmarks.md), and 64 sessions' opening rounds took
    # 190-405 ms in a process of their own against 464-565 in the gateway's. With
    # stage_devices, one process per device. None: on with a CUDA device; on the CPU off
    # (no CPU serves the loads where the lock is contended).
    stage_process: bool | None = None
    # A stage process that is alive but stuck (a GPU hang, a deadlock) would leave every
    # session waiting for audio for ever. The engine kills it, and its utterances end with
    # an error, when it has said nothing for this long or one piece of its device work (a
    # round, a graph capture, a compile) has run this long. The longest legitimate piece is
    # a compile of a new shape: seconds to a minute. 0: no watchdog. Needs stage_process.
    stage_stall_timeout_s: float = 120.0
    # vLLM's engine core alive but stuck (a GPU hang, a deadlock) answers nothing and raises
    # nothing. The engine reports itself failed (the gateway then drains and exits for a
    # restart) when LM streams have waited this long without any of them getting a token
    # (`engine.lm_watch`): overload still makes tokens, a stuck LM none. 0: no watch.
    lm_stall_timeout_s: float = 120.0
    # Under an NVIDIA MPS daemon: the percent of the GPU's SMs the stage's process(es) may
    # use, the rest left to vLLM's engine core. Unlimited, the stage's rounds fill the GPU
    # and vLLM's decode steps wait for SMs: 13-14.5 ms a token at 64 streams beside the
    # stage against 7.7-8.4 in time slices (rounds 19-21 of docs/benchmarks.md), and that
    # rate sets how long a burst's first chunks must be. None: no limit. Needs the stage's
    # own process (MPS reads it when a process creates its CUDA context).
    stage_mps_thread_percent: int | None = None
    # Under an NVIDIA MPS daemon: the stage's process(es) as MPS clients of this priority.
    # Below normal, vLLM's decode kernels go first when both wait for the GPU, and a first
    # chunk's wait for its tokens is LM steps. On one H100 at 272-304 sessions over 16 s
    # (round 55 of docs/benchmarks.md, one gateway normal between three below normal) vLLM
    # stepped at 6.3-8.6 ms a token below normal against 11.1-13.2 at normal (1.3-1.8x level
    # by level; the slower LM also kept more sessions open), and first audio p95 at 272
    # sessions was 362-770 ms against 974-1,013. Loads of 1 and 64 sessions not yet
    # measured this way, nor the torch LM backend. The other way round (vLLM
    # below normal, round 16, the stage then in the gateway's process) slowed vLLM 1.6x and
    # did not speed the stage. None: below normal when the stage has its own process and
    # vLLM is not the below-normal client (`resolved_stage_mps_priority`). Without a daemon
    # it does nothing.
    stage_mps_priority: MPSPriority | None = None
    text_normalization: bool = True
    warmup: bool = True
    # Start the LM backend while the audio stage is built and the flow warmed (vLLM's
    # engine core compiles in its own process meanwhile). Off: one after the other, as
    # measured so far. On the GPU, vLLM then sizes its KV cache while this process
    # allocates the flow's graphs; not yet run on the device.
    overlap_start: bool = False
    # Warm-up then also runs this many sentence-long utterances at once (at most
    # max_gpu_batch), so the stage's round times (`engine.first_chunk.RoundTimes`) know a
    # full batch before the first burst does: without one, the first 64-session burst
    # after a start was planned on small rounds and stalled (docs/benchmarks.md, round 11).
    # None: max_gpu_batch on a GPU; on the CPU only a few (a full batch of sentences takes
    # a while there, and no CPU serves bursts of 64). Any value >= 1 also runs one such
    # utterance alone, twice, for one-row round times (round 12); 0 runs neither.
    warmup_concurrency: int | None = None
    vllm_gpu_memory_utilization: float = 0.35
    vllm_max_model_len: int = 4096
    # vLLM's async scheduling runs one step ahead; a paused streaming-input (bistream)
    # request then leaks one token sampled past its fill, so bistream needs it off.
    vllm_async_scheduling: bool = False
    # Under an NVIDIA MPS daemon: the percent of the GPU's SMs vLLM's engine core may use,
    # the rest left to the audio stage (`engine.backends.vllm_backend.mps_thread_limit`).
    # Unlimited MPS gave 2% at 64 sessions on the H200 while vLLM decoded 1.6x slower beside
    # the stage (round 13 of docs/benchmarks.md); a limit is not measured yet. None: none.
    vllm_mps_thread_percent: int | None = None
    # Under an NVIDIA MPS daemon: vLLM's engine core as a "below_normal" MPS client, so that
    # the audio stage's kernels go first when both wait for the GPU (the stage is the
    # bottleneck; the LM decodes ~6x faster than speech plays at 64 sessions). One H200 run
    # (round 16 of docs/benchmarks.md): no faster opening round, vLLM 1.6x slower, as under
    # MPS without it. None: normal.
    vllm_mps_priority: MPSPriority | None = None
    # Run the RAS sampler's ~20 operators (`ras_logits.ras_log_probs`) compiled in vLLM's
    # engine core: eager they were ~1 ms of host time in each 3.2-3.5 ms decode step at one
    # stream (round 33 of docs/benchmarks.md). Compiles at engine start. Round 36 on the
    # H200: a long decode 0.17 ms a token faster, a first chunk 5 ms slower, so off.
    vllm_compile_sampling: bool = False
    # vLLM's CUDA graph mode (`CompilationConfig.cudagraph_mode`, lower-case). "full" replays
    # one graph for prefills and mixed batches too, where vLLM's own default
    # (full_and_piecewise) runs them piecewise with eager attention between the pieces: a
    # 0.5B model's prefill is host-bound. H200, round 37 of docs/benchmarks.md: a lone
    # 153-token prefill took 3.1 ms against 6.1 (first token p50 4.9 against 7.3 ms); through
    # the gateway, with 8-token first chunks, lone first audio had a median of 61 ms against
    # round 36's 67 (another machine), and 64 sessions over 16 s p95 83-97 ms against 136-138.
    # Batches of more tokens than vLLM's largest capture size (2 x lm_max_batch, at most 512)
    # run without graphs in either mode; a long decode ran 0.14 ms a
    # token slower (2.52 against 2.38 ms), the LM being far from the bottleneck. Engine start
    # captures more graphs (83 against 64 s alone). Where the attention backend cannot graph
    # mixed batches (FlashAttention 2 before Hopper, FlashAttention 4 on Blackwell) vLLM 0.26
    # logs a warning and runs its default instead.
    vllm_cudagraph_mode: VLLMGraphMode = DEFAULT_VLLM_GRAPH_MODE
    # Keep vLLM's own timings of its requests (queued, prefill, decode, its time to first
    # token: `engine.backends.lm_times`), exported as cosyvoice_engine_lm_server_* metrics.
    # Costs vLLM's per-step statistics in the gateway process, hence off by default.
    lm_timing: bool = False
    # Sequences the LM decodes together (torch backend: per step; vLLM: max_num_seqs);
    # utterances beyond it wait for a slot.
    lm_max_batch: int = 256
    seed: int | None = None
    # Random weights never emit eos; benchmarks and the random demo models fix the
    # speech length instead (25 tokens = 1 s). Used when a request does not set it.
    tokens_per_text_token: float | None = None

    def __post_init__(self) -> None:
        # Fail at configuration time, not when the first stage is built after model load.
        if self.stage_policy not in get_args(StagePolicy):
            raise ValueError(f"stage_policy must be one of {', '.join(get_args(StagePolicy))}, "
                             f"not {self.stage_policy!r}")
        if self.max_hop < GRID or self.max_hop % GRID:
            raise ValueError(f"max_hop must be a multiple of {GRID} tokens (chunks end on the flow's attention "
                             f"blocks), at least {GRID}, not {self.max_hop}")
        if self.max_gpu_batch < 1:
            raise ValueError(f"max_gpu_batch must be >= 1, not {self.max_gpu_batch}")
        if self.lm_max_batch < 1:
            raise ValueError(f"lm_max_batch must be >= 1 (utterances beyond it wait for a slot), not {self.lm_max_batch}")
        if self.first_chunk_learnt_rounds_crowd < 0:
            raise ValueError(f"first_chunk_learnt_rounds_crowd must be >= 0, not {self.first_chunk_learnt_rounds_crowd}")
        if self.idle_initial_hop < 0 or self.first_chunk_min_hop < 0 or self.first_chunk_min_hop_crowd < 0:
            raise ValueError("idle_initial_hop, first_chunk_min_hop and first_chunk_min_hop_crowd must be >= 0, "
                             f"not {self.idle_initial_hop}, {self.first_chunk_min_hop} and "
                             f"{self.first_chunk_min_hop_crowd}")
        if self.flow_split_prefix_rows is not None and self.flow_split_prefix_rows < 0:
            raise ValueError(f"flow_split_prefix_rows must be >= 0, not {self.flow_split_prefix_rows}")
        if self.vllm_cudagraph_mode not in get_args(VLLMGraphMode):
            raise ValueError(f"vllm_cudagraph_mode must be one of {', '.join(get_args(VLLMGraphMode))}, "
                             f"got {self.vllm_cudagraph_mode!r}")
        if self.flow_conv_kernel not in get_args(FlowConvKernel):
            raise ValueError(f"flow_conv_kernel must be one of {', '.join(get_args(FlowConvKernel))}, "
                             f"not {self.flow_conv_kernel!r}")
        if self.vocoder_snake_kernel not in get_args(SnakeKernelName):
            raise ValueError(f"vocoder_snake_kernel must be one of {', '.join(get_args(SnakeKernelName))}, "
                             f"not {self.vocoder_snake_kernel!r}")
        if self.flow_attention not in get_args(FlowAttention):
            raise ValueError(f"flow_attention must be one of {', '.join(get_args(FlowAttention))}, "
                             f"not {self.flow_attention!r}")
        if self.flow_dtype not in get_args(FlowDType):
            raise ValueError(f"flow_dtype must be one of {', '.join(get_args(FlowDType))}, not {self.flow_dtype!r}")
        if self.stage_profile_start < 0 or self.stage_profile_batches < 1 or self.stage_profile_min_chunks < 0:
            raise ValueError("stage_profile_start and stage_profile_min_chunks must be >= 0, "
                             "stage_profile_batches >= 1")
        if self.vllm_mps_thread_percent is not None and not 1 <= self.vllm_mps_thread_percent <= 100:
            raise ValueError("vllm_mps_thread_percent must be in 1..100")
        if self.stage_mps_thread_percent is not None:
            if not 1 <= self.stage_mps_thread_percent <= 100:
                raise ValueError("stage_mps_thread_percent must be in 1..100")
            if self.stage_process is False:
                raise ValueError("stage_mps_thread_percent needs the stage's own process (stage_process)")
        if self.stage_mps_priority is not None:
            if self.stage_mps_priority not in get_args(MPSPriority):
                raise ValueError(f"stage_mps_priority must be one of {', '.join(get_args(MPSPriority))}, "
                                 f"not {self.stage_mps_priority!r}")
            if self.stage_process is False:
                raise ValueError("stage_mps_priority needs the stage's own process (stage_process)")
            if self.stage_mps_priority == self.vllm_mps_priority == "below_normal":
                raise ValueError("stage_mps_priority and vllm_mps_priority both below_normal order nothing: "
                                 "set one of them")
        if not self.stage_stall_timeout_s >= 0:  # also refuses NaN
            raise ValueError(f"stage_stall_timeout_s must be >= 0 (0: no watchdog), not {self.stage_stall_timeout_s}")
        if not self.lm_stall_timeout_s >= 0:
            raise ValueError(f"lm_stall_timeout_s must be >= 0 (0: no watch), not {self.lm_stall_timeout_s}")
        if self.vllm_mps_priority is not None and self.vllm_mps_priority not in get_args(MPSPriority):
            raise ValueError(f"vllm_mps_priority must be one of {', '.join(get_args(MPSPriority))}, "
                             f"not {self.vllm_mps_priority!r}")
        if self.warmup_concurrency is not None and self.warmup_concurrency < 0:
            raise ValueError("warmup_concurrency must be >= 0")
        if not self.first_chunk_margin >= 0:  # also refuses NaN
            raise ValueError("first_chunk_margin must be >= 0")
        if self.first_chunk_opening_rate not in get_args(OpeningRate):
            raise ValueError(f"first_chunk_opening_rate must be one of {', '.join(get_args(OpeningRate))}, "
                             f"not {self.first_chunk_opening_rate!r}")
        if not 0 <= self.first_chunk_hold_ms <= MAX_FIRST_CHUNK_HOLD_MS:  # also refuses NaN
            raise ValueError(f"first_chunk_hold_ms must be in 0..{MAX_FIRST_CHUNK_HOLD_MS:g}")
        if not 0 <= self.first_chunk_burst_hold_ms <= MAX_FIRST_CHUNK_HOLD_MS:
            raise ValueError(f"first_chunk_burst_hold_ms must be in 0..{MAX_FIRST_CHUNK_HOLD_MS:g}")
        if self.first_chunk_burst_rows < 1:
            raise ValueError("first_chunk_burst_rows must be at least 1")
        if not 0 <= self.chunk_patience_s <= 60:  # also refuses NaN
            raise ValueError("chunk_patience_s must be in 0..60")
        if not self.max_unread_audio_s >= 0:  # also refuses NaN
            raise ValueError("max_unread_audio_s must be >= 0 (0 = no limit)")
        if not 0 <= self.first_chunk_hold_share <= 0.5:
            raise ValueError("first_chunk_hold_share must be in 0..0.5")
        if not 0 <= self.stage_deadline_cut_margin_ms <= 1000:  # also refuses NaN
            raise ValueError("stage_deadline_cut_margin_ms must be in 0..1000")
        if not 0 <= self.stage_pipeline_lead_ms <= MAX_PIPELINE_LEAD_MS:  # also refuses NaN
            raise ValueError(f"stage_pipeline_lead_ms must be in 0..{MAX_PIPELINE_LEAD_MS:g}")
        if not self.stage_window_tolerance >= 0:  # also refuses NaN
            raise ValueError("stage_window_tolerance must be >= 0")
        if self.flow_graph_max_rows < 0 or self.flow_graph_shared_rows < 0:
            raise ValueError("flow_graph_max_rows and flow_graph_shared_rows must be >= 0")
        if self.flow_graph_limit < 1:
            raise ValueError("flow_graph_limit must be at least 1")
        rows = self.flow_graph_rows
        if not rows or rows[0] < 1 or any(b <= a for a, b in zip(rows, rows[1:])):
            raise ValueError(f"flow_graph_rows must be increasing row counts >= 1, got {rows}")
        frames = self.flow_graph_frames
        if any(f < 1 for f in frames) or any(b <= a for a, b in zip(frames, frames[1:])):
            raise ValueError(f"flow_graph_frames must be increasing frame counts >= 1, got {frames}")
        rows = self.vocoder_graph_rows
        if not rows or rows[0] < 1 or any(b <= a for a, b in zip(rows, rows[1:])):
            raise ValueError(f"vocoder_graph_rows must be increasing row counts >= 1, got {rows}")
        if self.flow_prompt_cache_bytes < 0:
            raise ValueError("flow_prompt_cache_bytes must be >= 0")
        if self.flow_split_call_cost < 0:
            raise ValueError("flow_split_call_cost must be >= 0")
        if self.flow_context_cache_bytes < 0 or self.flow_context_min_rows < 1:
            raise ValueError("flow_context_cache_bytes must be >= 0 and flow_context_min_rows >= 1")
        if self.flow_context_cache_bytes > 0 and self.flow_left_context <= 0:
            raise ValueError("flow_context_cache_bytes needs a bounded flow_left_context (> 0 tokens)")
        if self.flow_context_cache_bytes > 0 and not self.flow_prompt_cache:
            raise ValueError("flow_context_cache_bytes needs flow_prompt_cache (its rings follow the cached prompt)")

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_stage_process(self) -> bool:
        if self.stage_process is not None:
            return self.stage_process
        return self.resolved_device().type == "cuda"

    def resolved_stage_mps_priority(self) -> MPSPriority:
        if self.stage_mps_priority is not None:
            return self.stage_mps_priority
        # Only one of the two can go second; one set by hand wins.
        return "normal" if self.vllm_mps_priority == "below_normal" else "below_normal"

    def cut_shift_s(self) -> float:
        """What the stage's cuts add to a chunk's deadline (which keeps DEADLINE_MARGIN_S)
        to judge it late by `stage_deadline_cut_margin_ms` instead."""
        return DEADLINE_MARGIN_S - self.stage_deadline_cut_margin_ms / 1000

    def resolved_flow_dtype(self) -> torch.dtype | str:
        return "auto" if self.flow_dtype == "auto" else getattr(torch, self.flow_dtype)

    def resolved_backend(self) -> str:
        if self.lm_backend != "auto":
            return self.lm_backend
        if self.resolved_device().type == "cuda":
            try:
                import vllm  # noqa: F401
            except ImportError:
                return "torch"
            return "vllm"
        return "torch"
