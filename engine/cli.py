"""Offline synthesis to a WAV file.

    cosyvoice-tts --model tiny-random --text "Hello there." --out hello.wav
    cosyvoice-tts --model /models/Fun-CosyVoice3-0.5B --prompt-wav me.wav --prompt-text "..." \\
                  --text "..." --mode instruct --instruction "Speak happily." --out out.wav
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from .config import EngineConfig
from .engine import Engine
from .errors import EngineError
from .hub import resolve_model
from .models.loader import ModelDirError
from .types import SPEED_RANGE, SessionOptions
from .wavio import read_wav, write_wav

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PROMPT = REPO_ROOT / "assets" / "default.wav"


class CannotWrite(Exception):
    """The WAV could not be written (after the whole synthesis)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cosyvoice-tts", description="Synthesise speech to a WAV file (no server).")
    p.add_argument("--model", default="tiny-random", help="model directory, hub repo id, or tiny-random / full-random / tiny-random-cv2 / full-random-cv2")
    p.add_argument("--cache-dir", type=Path, default=Path("data/models"), help="where downloaded/random models are kept")
    p.add_argument("--text", required=True, help="text to speak")
    p.add_argument("--out", type=Path, required=True, help="output WAV path (24 kHz mono 16-bit)")
    p.add_argument("--prompt-wav", type=Path, default=DEFAULT_PROMPT, help="voice prompt audio (WAV, 3-30 s)")
    p.add_argument("--prompt-text", default=None, help="transcript of the prompt (default: the .txt beside the wav)")
    p.add_argument("--mode", choices=["zero_shot", "instruct", "cross_lingual"], default="zero_shot")
    p.add_argument("--instruction", default=None, help="instruct mode: how to speak, e.g. 'Speak happily.'")
    p.add_argument("--speed", type=float, default=1.0, help=f"speaking rate, {SPEED_RANGE[0]:g} to {SPEED_RANGE[1]:g}")
    p.add_argument("--device", default="auto")
    p.add_argument("--lm-backend", default="auto", choices=["auto", "torch", "vllm"])
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--tokens-per-text-token",
        type=float,
        default=None,
        help="fix the speech length (random weights never stop on their own; tiny-random defaults to 3)",
    )
    return p


async def _run(a: argparse.Namespace) -> int:
    model_dir = resolve_model(a.model, a.cache_dir)
    transcript = a.prompt_text
    if transcript is None:
        txt = a.prompt_wav.with_suffix(".txt")
        if not txt.is_file():
            print(f"cosyvoice-tts: --prompt-text is required ({txt} not found)", file=sys.stderr)
            return 2
        transcript = txt.read_text(encoding="utf-8").strip()
    try:
        wav, sr = read_wav(a.prompt_wav)
    except (OSError, ValueError) as exc:
        print(f"cosyvoice-tts: {exc}", file=sys.stderr)
        return 2
    tptt = a.tokens_per_text_token
    if tptt is None and "-random" in a.model:
        tptt = 3.0
    t0 = time.perf_counter()
    engine = await Engine.create(EngineConfig(model_dir=model_dir, device=a.device, lm_backend=a.lm_backend, warmup=False))
    try:
        voice = await engine.prepare_voice("prompt", wav, sr, transcript)
        opts = SessionOptions(mode=a.mode, instruction=a.instruction, speed=a.speed, seed=a.seed, tokens_per_text_token=tptt)
        t1 = time.perf_counter()
        pcm = await engine.synthesize(a.text, voice, opts)
        t2 = time.perf_counter()
    finally:
        await engine.close()
    try:
        write_wav(a.out, pcm, engine.sample_rate)
    except OSError as exc:
        raise CannotWrite(f"cannot write {a.out}: {exc.strerror or exc}") from None
    dur = len(pcm) / engine.sample_rate
    print(f"wrote {a.out}: {dur:.2f} s of audio, load {t1 - t0:.1f} s, synthesis {t2 - t1:.2f} s (RTF {(t2 - t1) / max(dur, 1e-9):.2f})")
    return 0


def main(argv: list[str] | None = None) -> None:
    p = build_parser()
    a = p.parse_args(argv)
    if not SPEED_RANGE[0] <= a.speed <= SPEED_RANGE[1]:  # also refuses nan
        p.error(f"--speed must be within [{SPEED_RANGE[0]:g}, {SPEED_RANGE[1]:g}], not {a.speed:g}")
    ratio = a.tokens_per_text_token
    if ratio is not None and not 0 < ratio <= 50:  # the gateway's own bound (engine.tokens_per_text_token)
        p.error(f"--tokens-per-text-token must be within (0, 50], not {ratio:g}")
    if a.mode == "instruct" and not a.instruction:  # the engine says so only after loading the model
        p.error("--mode instruct needs --instruction")
    try:
        raise SystemExit(asyncio.run(_run(a)))
    except (ModelDirError, EngineError, CannotWrite) as exc:
        print(f"cosyvoice-tts: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
