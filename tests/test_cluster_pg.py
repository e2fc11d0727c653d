"""Two real gateway processes sharing one PostgreSQL voice store (issue #11).

Each replica is `python -m gateway --model tiny-random` with its own data dir and port,
both pointed at one throwaway PostgreSQL server on loopback. Register on A, speak on B,
delete on B, gone on A. Synthesis and deletion are checked on the very next request
(the store consults the database on each); the listings, which follow a NOTIFY, are
polled against a deadline. Start-up is awaited by polling /ready with a deadline.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import httpx
import numpy as np
import pytest

from gateway.audio_files import wav_bytes
from pg_server import PgServer, find_pg_bindir, free_port, temporary_postgres

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT = 240.0  # two replicas load and warm up on two CPU cores at once
SPEECH = {"model": "tts-1", "input": "Hello from the other replica.", "response_format": "wav",
          "seed": 7, "tokens_per_text_token": 2.0}

if find_pg_bindir() is None:
    if os.environ.get("CI"):
        raise RuntimeError("CI must have PostgreSQL installed (Makefile system-deps)")
    pytest.skip("PostgreSQL server binaries not installed", allow_module_level=True)


@dataclass
class Replica:
    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


def start_replica(name: str, tmp: Path, db_url: str) -> Replica:
    port = free_port()
    data = tmp / f"data-{name}"
    log = tmp / f"{name}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("COSYVOICE_GW_")}
    cmd = [sys.executable, "-m", "gateway", "--model", "tiny-random", "--port", str(port),
           "--data-dir", str(data), "--voice-store", db_url, "--assets-dir", str(REPO / "assets"),
           "--log-level", "info"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    return Replica(name, port, proc, log)


def stop_replica(r: Replica) -> None:
    if r.proc.poll() is None:
        r.proc.send_signal(signal.SIGTERM)
        try:
            r.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            r.proc.kill()
            r.proc.wait()


def poll(check: Callable[[], bool], timeout: float, what: str, replicas: list[Replica]) -> None:
    """Re-run `check` until it holds; fail with the replicas' logs at the deadline."""
    deadline = time.monotonic() + timeout
    while not check():
        for r in replicas:
            if r.proc.poll() is not None:
                pytest.fail(f"replica {r.name} exited with {r.proc.returncode}:\n{r.log_tail()}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}:\n" + "\n".join(f"--- {r.name}\n{r.log_tail()}" for r in replicas))
        time.sleep(0.1)  # polling interval of a condition with a deadline, not a synchronisation sleep


def is_ready(r: Replica) -> bool:
    try:
        return httpx.get(r.base + "/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PgServer, Replica, Replica]]:
    tmp = tmp_path_factory.mktemp("cluster")
    with temporary_postgres() as pg:
        # Started together on purpose: both create the schema and register the bundled
        # voice at the same moment, the race a rolling deployment produces.
        a = start_replica("a", tmp, pg.url)
        b = start_replica("b", tmp, pg.url)
        try:
            poll(lambda: is_ready(a) and is_ready(b), START_TIMEOUT, "both replicas ready", [a, b])
            yield pg, a, b
        finally:
            stop_replica(a)
            stop_replica(b)


def prompt_wav() -> bytes:
    sr = 24000
    t = np.arange(int(3.5 * sr)) / sr
    return wav_bytes((0.3 * np.sin(2 * np.pi * 180.0 * t) * (1 + 0.3 * np.sin(2 * np.pi * 3 * t))).astype(np.float32), sr)


def test_register_on_a_speak_on_b_delete_on_b_gone_on_a(cluster: tuple[PgServer, Replica, Replica]) -> None:
    _, a, b = cluster
    with httpx.Client(timeout=60) as http:
        # The bundled voice, registered concurrently by both replicas at start, is one row.
        for r in (a, b):
            ids = [v["id"] for v in http.get(r.base + "/v1/voices").json()["data"]]
            assert ids.count("default") == 1, ids

        created = http.post(a.base + "/v1/voices",
                            files={"file": ("shared.wav", prompt_wav(), "audio/wav")},
                            data={"id": "shared_voice", "transcript": "This is the shared prompt voice."})
        assert created.status_code == 201, created.text

        # Speak on B right away: B has never seen this voice before this request.
        on_b = http.post(b.base + "/v1/audio/speech", json={**SPEECH, "voice": "shared_voice"})
        assert on_b.status_code == 200, on_b.text
        assert on_b.content[:4] == b"RIFF" and len(on_b.content) > 44 + 2 * 1000
        # Same weights, same seed, same prompt features: A's audio is identical, which
        # shows B used the features A computed (not, say, the default voice).
        on_a = http.post(a.base + "/v1/audio/speech", json={**SPEECH, "voice": "shared_voice"})
        assert on_a.status_code == 200 and on_a.content == on_b.content
        default_b = http.post(b.base + "/v1/audio/speech", json={**SPEECH, "voice": "default"})
        assert default_b.status_code == 200 and default_b.content != on_b.content

        # Registering the same id on B is a conflict: the database decides, not B's memory.
        dup = http.post(b.base + "/v1/voices", files={"file": ("x.wav", prompt_wav(), "audio/wav")},
                        data={"id": "shared_voice", "transcript": "Another one."})
        assert dup.status_code == 409 and dup.json()["error"]["code"] == "voice_exists"

        # B's listing follows A's commit through NOTIFY (milliseconds; bounded here).
        poll(lambda: http.get(b.base + "/v1/voices/shared_voice").status_code == 200, 10, "B lists the voice", [a, b])

        deleted = http.delete(b.base + "/v1/voices/shared_voice")
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True

        # Gone on A at once: the next requests after the delete committed.
        gone = http.post(a.base + "/v1/audio/speech", json={**SPEECH, "voice": "shared_voice"})
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "voice_not_found"
        assert http.delete(a.base + "/v1/voices/shared_voice").status_code == 404
        poll(lambda: http.get(a.base + "/v1/voices/shared_voice").status_code == 404, 10, "A drops the voice", [a, b])
        assert "shared_voice" not in [v["id"] for v in http.get(a.base + "/v1/voices").json()["data"]]

        # Nothing of the voice is left in the database.
        import psycopg

        with psycopg.connect(cluster[0].url) as conn:
            assert conn.execute("SELECT count(*) FROM cosyvoice_voices WHERE id = 'shared_voice'").fetchone()[0] == 0
            assert conn.execute("SELECT count(*) FROM cosyvoice_voices").fetchone()[0] == 1  # "default"
