"""Two real gateway processes sharing one PostgreSQL voice store, behind nginx (issue #11).

Each replica is `python -m gateway --model tiny-random` with its own data dir and port,
both pointed at one throwaway PostgreSQL server on loopback. Register on A, speak on B,
delete on B, gone on A. Synthesis and deletion are checked on the very next request
(the store consults the database on each); the listings, which follow a NOTIFY, are
polled against a deadline. Start-up is awaited by polling /ready with a deadline.

Then the compose profile's own deploy/nginx.conf (upstream addresses and listen port
rewritten for loopback) balances the two: WebSockets pass through it, and a new
session goes to the replica with fewer open connections.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import httpx
import numpy as np
import pytest

from gateway.audio_files import wav_bytes
from helpers import FIXED_CHUNKS
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
           "--log-level", "info", *FIXED_CHUNKS]  # the replicas' audio is compared
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


# ------------------------------------------------------------------ nginx in front
def find_nginx() -> str | None:
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if Path(p).is_file()), None)


def render_nginx_conf(replicas: list[Replica], listen_port: int, root: Path) -> str:
    """deploy/nginx.conf for loopback: compose service names become the test replicas'
    ports. `resolve` (and its Docker DNS resolver) is dropped: it needs nginx >= 1.27.3
    and a DNS name, while the Debian package is older and the replicas are IPs here."""
    out: list[str] = [f"pid {root}/nginx.pid;"]
    pending = list(replicas)
    for line in (REPO / "deploy" / "nginx.conf").read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("server gateway-gpu"):
            params = [w for w in stripped.rstrip(";").split()[2:] if w != "resolve"]
            line = f"        server 127.0.0.1:{pending.pop(0).port} {' '.join(params)};"
        elif stripped.startswith("resolver "):
            continue
        elif stripped == "listen 8080;":
            line = f"        listen 127.0.0.1:{listen_port};"
        elif stripped == "http {":
            line += "".join(f"\n    {kind}_temp_path {root}/{kind};" for kind in
                            ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        out.append(line)
    assert not pending, "deploy/nginx.conf has fewer upstream servers than replicas"
    return "\n".join(out) + "\n"


@contextlib.contextmanager
def running_nginx(binary: str, replicas: list[Replica]) -> Iterator[int]:
    root = Path(tempfile.mkdtemp(prefix="cvgw-nginx-"))
    os.chmod(root, 0o777)  # workers drop root privileges and write their temp files here
    port = free_port()
    conf = root / "nginx.conf"
    conf.write_text(render_nginx_conf(replicas, port, root))
    log = root / "nginx.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([binary, "-p", str(root), "-c", str(conf), "-e", str(root / "error.log"),
                                 "-g", "daemon off;"], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                pytest.fail(f"nginx exited with {proc.returncode}:\n{log.read_text()}\n"
                            f"{(root / 'error.log').read_text() if (root / 'error.log').exists() else ''}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/lb-health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "nginx did not start"
            time.sleep(0.05)  # polling a starting process against a deadline
        yield port
    finally:
        if proc.poll() is None:
            proc.terminate()  # fast shutdown, also closes proxied WebSockets
            proc.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)


def sessions_active(r: Replica) -> int:
    text = httpx.get(r.base + "/metrics", timeout=10).text
    (line,) = [ln for ln in text.splitlines() if ln.startswith("cosyvoice_sessions_active ")]
    return int(float(line.split()[1]))


def test_nginx_balances_websockets_by_least_connections(cluster: tuple[PgServer, Replica, Replica]) -> None:
    from websockets.sync.client import connect

    binary = find_nginx()
    if binary is None:
        if os.environ.get("CI"):
            raise RuntimeError("CI must have nginx installed (Makefile system-deps)")
        pytest.skip("nginx not installed")
    _, a, b = cluster
    with running_nginx(binary, [a, b]) as port, httpx.Client(timeout=60) as http:
        base, ws_url = f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port}/v1/tts/stream"
        assert http.get(base + "/ready").status_code == 200
        speech = http.post(base + "/v1/audio/speech", json={**SPEECH, "voice": "default"})
        assert speech.status_code == 200 and speech.content[:4] == b"RIFF"
        # An HTTP session closes just after its last byte: start from a quiet cluster.
        poll(lambda: sessions_active(a) == sessions_active(b) == 0, 10, "no open sessions", [a, b])

        with connect(ws_url, open_timeout=30) as ws1:
            assert json.loads(ws1.recv(timeout=30))["type"] == "session_started"
            first = [sessions_active(a), sessions_active(b)]
            assert sorted(first) == [0, 1]
            # A short request in between: plain round-robin would now send the next
            # connection back to ws1's replica; least_conn sends it to the idle one.
            assert http.get(base + "/v1/models").status_code == 200
            with connect(ws_url, open_timeout=30) as ws2:
                assert json.loads(ws2.recv(timeout=30))["type"] == "session_started"
                assert [sessions_active(a), sessions_active(b)] == [1, 1]

                # Frames flow both ways through the proxy: a whole context on ws2.
                for msg in ({"type": "open", "context_id": "c1", "voice": "default"},
                            {"type": "text", "context_id": "c1", "text": "Hello through the balancer."},
                            {"type": "end", "context_id": "c1"}):
                    ws2.send(json.dumps(msg))
                audio_bytes, done = 0, None
                while done is None:
                    frame = ws2.recv(timeout=60)
                    if isinstance(frame, bytes):
                        audio_bytes += len(frame)
                        continue
                    event = json.loads(frame)
                    assert event["type"] != "error", event
                    if event["type"] == "done" and event["context_id"] == "c1":
                        done = event
                assert audio_bytes > 0 and done["audio_samples"] > 0
