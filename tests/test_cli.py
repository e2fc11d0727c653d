"""`cosyvoice-tts` writes a WAV from the command line (offline API, no server)."""

import subprocess
import sys
import wave


def test_cli_synthesises_a_wav(tiny_model_dir, tmp_path):
    out = tmp_path / "out.wav"
    r = subprocess.run(
        [sys.executable, "-m", "engine.cli", "--model", str(tiny_model_dir), "--text", "Hello there.",
         "--out", str(out), "--device", "cpu", "--tokens-per-text-token", "4", "--seed", "0"],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout
    with wave.open(str(out)) as w:
        assert w.getframerate() == 24000 and w.getnchannels() == 1 and w.getsampwidth() == 2
        frames = w.getnframes()
        data = w.readframes(frames)
    # a whole number of speech tokens (960 samples each), and not silence
    assert frames > 0 and frames % 960 == 0
    assert max(abs(int.from_bytes(data[i:i + 2], "little", signed=True)) for i in range(0, len(data), 2)) > 0


def test_cli_reports_a_missing_model_in_one_line(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "engine.cli", "--model", str(tmp_path / "nope"), "--text", "x", "--out", str(tmp_path / "o.wav")],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and "cosyvoice-tts:" in r.stderr


def test_cli_refuses_a_speed_or_a_prompt_it_cannot_use_in_one_line(tiny_model_dir, tmp_path):
    """A speed outside the served range is refused before the model loads (the engine's
    SessionOptions would raise a traceback after it); an unreadable prompt says why."""
    base = [sys.executable, "-m", "engine.cli", "--model", str(tiny_model_dir), "--text", "x",
            "--out", str(tmp_path / "o.wav"), "--device", "cpu"]
    r = subprocess.run([*base, "--speed", "9"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--speed must be within [0.25, 4]" in r.stderr and "Traceback" not in r.stderr
    for ratio in ("-2", "0", "nan"):  # -2 made 0.04 s of audio; nan reached the engine
        r = subprocess.run([*base, "--tokens-per-text-token", ratio], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "--tokens-per-text-token must be within (0, 50]" in r.stderr, (ratio, r.stderr)
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"not audio")
    (tmp_path / "bad.txt").write_text("hello")
    r = subprocess.run([*base, "--prompt-wav", str(bad)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == f"cosyvoice-tts: {bad}: not a RIFF/WAVE file"


def test_gateway_without_a_reachable_hub_names_the_tiny_model(tmp_path):
    import os

    env = dict(os.environ, HF_ENDPOINT="http://127.0.0.1:9", MODELSCOPE_ENDPOINT="http://127.0.0.1:9")
    env = {k: v for k, v in env.items() if not k.startswith("COSYVOICE_GW_")}
    r = subprocess.run(
        [sys.executable, "-m", "gateway", "--data-dir", str(tmp_path), "--config", os.devnull],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--model tiny-random" in lines[0] and "Fun-CosyVoice3" in lines[0]


def test_gateway_refuses_nonsense_limits_before_loading_anything(tmp_path):
    """A 0 or negative limit would not switch a check off but refuse or close everything (or,
    for the LM's batch, hang the start): each is one line on stderr and exit status 2, before
    a model is resolved (the model named here does not exist)."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("COSYVOICE_GW_")}
    for flag, value, name in (("--max-sessions", "0", "max_sessions"), ("--ws.max-pending-bytes", "0", "max_pending_bytes"),
                              ("--ws.max-lag-s", "-1", "max_lag_s"), ("--voices.max-upload-bytes", "0", "max_upload_bytes"),
                              ("--engine.lm-max-batch", "0", "lm_max_batch"), ("--port", "70000", "port"),
                              ("--engine.lm-backend", "vLLM", "lm_backend"), ("--log-level", "verbose", "log_level")):
        r = subprocess.run(
            [sys.executable, "-m", "gateway", "--data-dir", str(tmp_path), "--config", os.devnull,
             "--model", str(tmp_path / "nope"), flag, value],
            capture_output=True, text=True, timeout=120, env=env,
        )
        assert r.returncode == 2, (flag, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and name in lines[0], (flag, r.stderr)


def test_cli_reports_what_the_engine_refuses_and_an_unwritable_out_in_one_line(tiny_model_dir, tmp_path):
    """Before: a traceback for a text with nothing to speak, for instruct mode without an
    instruction (after loading the model), and for an --out it cannot write (after the
    whole synthesis, followed by a second one from `wave`'s destructor)."""
    base = [sys.executable, "-m", "engine.cli", "--model", str(tiny_model_dir), "--device", "cpu"]
    r = subprocess.run([*base, "--text", "Hello.", "--out", str(tmp_path / "o.wav"), "--mode", "instruct"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--instruction" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = subprocess.run([*base, "--text", "", "--out", str(tmp_path / "o.wav")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.strip() == "cosyvoice-tts: nothing to speak after normalisation", r.stderr
    out = tmp_path / "no-such-dir" / "o.wav"
    r = subprocess.run([*base, "--text", "Hello.", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and r.stderr.strip() == f"cosyvoice-tts: cannot write {out}: No such file or directory", r.stderr
