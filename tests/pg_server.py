"""A throwaway PostgreSQL server for tests: initdb into a temp dir, serve on loopback.

Uses the Debian `postgresql` package's binaries (the Makefile's `system-deps` installs
it). PostgreSQL refuses to run as root, so under root (CI) both `initdb` and `postgres`
run as the `postgres` system user the package creates (`subprocess`'s ``user=``, no
sudo needed); as any other user they run as that user. The server lives only as long
as the context manager: data dir, socket and process are removed afterwards.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator


def find_pg_bindir() -> Path | None:
    """Directory holding `initdb` and `postgres`: the newest Debian install, else PATH."""
    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin"),
                        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0, reverse=True)
    for bindir in candidates:
        if (bindir / "initdb").is_file() and (bindir / "postgres").is_file():
            return bindir
    initdb = shutil.which("initdb")
    if initdb and shutil.which("postgres"):
        return Path(initdb).resolve().parent
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class PgServer:
    port: int
    user: str
    dbname: str
    root: Path

    @property
    def url(self) -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{self.dbname}"


def _run_as() -> dict[str, object]:
    if os.geteuid() != 0:
        return {}
    try:
        pw = pwd.getpwnam("postgres")
    except KeyError as exc:
        raise RuntimeError("running as root needs the 'postgres' system user (apt-get install postgresql)") from exc
    return {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}


@contextlib.contextmanager
def temporary_postgres(start_timeout: float = 60.0) -> Iterator[PgServer]:
    bindir = find_pg_bindir()
    if bindir is None:
        raise FileNotFoundError("PostgreSQL server binaries not found (apt-get install postgresql)")
    as_user = _run_as()
    # Not under pytest's tmp_path: its parents are private to root, and the server
    # user must be able to reach its data dir.
    root = Path(tempfile.mkdtemp(prefix="cvgw-pg-"))
    proc: subprocess.Popen[bytes] | None = None
    try:
        if as_user:
            os.chown(root, int(as_user["user"]), int(as_user["group"]))  # type: ignore[call-overload]
        data = root / "data"
        log_path = root / "server.log"
        env = {**os.environ, "LC_ALL": "C", "LANG": "C"}
        subprocess.run(
            [str(bindir / "initdb"), "-D", str(data), "-U", "gw", "-A", "trust", "-E", "UTF8",
             "--no-locale", "--no-sync"],
            check=True, capture_output=True, cwd=root, env=env, timeout=120, **as_user,  # type: ignore[arg-type]
        )
        port = free_port()
        with open(log_path, "wb") as log_file:
            # Durability is pointless for a throwaway cluster; skipping fsync keeps tests fast.
            proc = subprocess.Popen(
                [str(bindir / "postgres"), "-D", str(data), "-p", str(port), "-k", str(root),
                 "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "synchronous_commit=off",
                 "-c", "full_page_writes=off"],
                stdout=log_file, stderr=subprocess.STDOUT, cwd=root, env=env, **as_user,  # type: ignore[arg-type]
            )
        server = PgServer(port=port, user="gw", dbname="postgres", root=root)
        _wait_until_accepting(server, proc, log_path, start_timeout)
        yield server
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # "fast" shutdown: ends sessions, no wait for clients
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(root, ignore_errors=True)


def _wait_until_accepting(server: PgServer, proc: subprocess.Popen[bytes], log_path: Path, timeout: float) -> None:
    import psycopg

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"postgres exited with {proc.returncode}:\n{log_path.read_text(errors='replace')}")
        try:
            with psycopg.connect(server.url, connect_timeout=2) as conn:
                conn.execute("SELECT 1")
            return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"postgres not accepting connections after {timeout} s") from None
            # Polling a starting server (there is no readiness event to wait on).
            time.sleep(0.05)
