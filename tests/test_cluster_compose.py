"""The docker-compose `cluster` profile and deploy/nginx.conf, parsed and cross-checked.

No Docker here: the compose file is read as YAML (anchors and merge keys resolved the
way compose resolves them), the nginx config with a small tokenizer, and each side is
checked against the other and against the gateway's own settings loader.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from gateway.settings import Settings, load_settings
from gateway.voice_pg import PgVoiceStore, create_voice_store

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------ a tiny nginx parser
@dataclass
class Block:
    name: str
    args: list[str]
    directives: list[tuple[str, list[str]]] = field(default_factory=list)
    children: list["Block"] = field(default_factory=list)

    def values(self, name: str) -> list[list[str]]:
        return [args for n, args in self.directives if n == name]

    def one(self, name: str) -> list[str]:
        found = self.values(name)
        assert len(found) == 1, f"{self.name} {self.args}: expected one '{name}', found {len(found)}"
        return found[0]

    def blocks(self, name: str) -> list["Block"]:
        return [b for b in self.children if b.name == name]


def parse_nginx(text: str) -> Block:
    tokens = re.findall(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|[{};]|[^\s{};]+',
                        re.sub(r"#[^\n]*", "", text))
    root = Block("main", [])
    stack, words = [root], []
    for tok in tokens:
        if tok == "{":
            child = Block(words[0], words[1:])
            stack[-1].children.append(child)
            stack.append(child)
            words = []
        elif tok == "}":
            assert not words, f"directive without ';' before '}}': {words}"
            stack.pop()
            assert stack, "unbalanced '}'"
        elif tok == ";":
            stack[-1].directives.append((words[0], words[1:]))
            words = []
        else:
            words.append(tok.strip("'\"") if tok[0] in "'\"" else tok)
    assert len(stack) == 1 and not words, "unbalanced '{' or a trailing directive"
    return root


def seconds(value: str) -> float:
    m = re.fullmatch(r"(\d+)(ms|s|m|h)?", value)
    assert m, value
    return int(m.group(1)) * {"ms": 0.001, "s": 1, None: 1, "m": 60, "h": 3600}[m.group(2)]


def size_bytes(value: str) -> int:
    m = re.fullmatch(r"(\d+)([kKmMgG])?", value)
    assert m, value
    return int(m.group(1)) * {None: 1, "k": 1024, "m": 1024**2, "g": 1024**3}[(m.group(2) or "").lower() or None]


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def cluster(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in compose["services"].items() if "cluster" in svc.get("profiles", [])}


def replicas(cluster: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in cluster.items()
            if any(k.startswith("COSYVOICE_GW_") for k in s.get("environment", {}))}


def lb_service(cluster: dict[str, dict[str, Any]]) -> dict[str, Any]:
    (lb,) = [s for s in cluster.values() if str(s.get("image", "")).startswith("nginx")]
    return lb


@pytest.fixture(scope="module")
def nginx() -> Block:
    return parse_nginx((ROOT / "deploy" / "nginx.conf").read_text())


# ------------------------------------------------------------------ compose
def test_single_gpu_default_is_untouched_and_cluster_is_opt_in(compose: dict[str, Any], cluster) -> None:
    assert "profiles" not in compose["services"]["gateway"]  # `docker compose up` = one GPU, as before
    assert len(replicas(cluster)) >= 2
    assert lb_service(cluster) and any(str(s.get("image", "")).startswith("postgres") for s in cluster.values())
    # Only the balancer publishes a port, the same one the single-GPU service uses.
    published = {n: s["ports"] for n, s in cluster.items() if s.get("ports")}
    assert list(published.values()) == [["8080:8080"]] and compose["services"]["gateway"]["ports"] == ["8080:8080"]
    for volume in sum((s.get("volumes", []) for s in cluster.values()), []):
        name = volume.split(":")[0]
        assert name.startswith("./") or name in compose["volumes"], volume


def test_each_replica_reserves_its_own_gpu(cluster) -> None:
    seen: list[str] = []
    for name, svc in replicas(cluster).items():
        (dev,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"] and "count" not in dev
        assert len(dev["device_ids"]) == 1, name
        seen += dev["device_ids"]
        # Replicas keep their own data volume (model cache); voices are in PostgreSQL.
        assert len({v.split(":")[0] for v in svc["volumes"]}) == 1
    assert len(seen) == len(set(seen)), f"two replicas share a GPU: {seen}"
    volumes = [svc["volumes"][0].split(":")[0] for svc in replicas(cluster).values()]
    assert len(volumes) == len(set(volumes))


def test_replicas_share_the_postgres_service(cluster, tmp_path: Path) -> None:
    pg_name, pg = next((n, s) for n, s in cluster.items() if str(s.get("image", "")).startswith("postgres"))
    assert "pg_isready" in pg["healthcheck"]["test"]
    for name, svc in replicas(cluster).items():
        env = {k: str(v) for k, v in svc["environment"].items()}
        gw_env = {k: v for k, v in env.items() if k.startswith("COSYVOICE_GW_") and "${" not in v}
        settings, _ = load_settings([], environ=gw_env)  # every variable is a real option
        url = urlsplit(settings.voice_store)
        assert url.scheme == "postgresql" and url.hostname == pg_name and url.port in (None, 5432)
        assert url.username == pg["environment"]["POSTGRES_USER"]
        assert url.path.lstrip("/") == pg["environment"]["POSTGRES_DB"]
        assert url.password is None  # secrets stay out of the URL (and --print-config)
        assert env["PGPASSWORD"] == pg["environment"]["POSTGRES_PASSWORD"]
        assert isinstance(create_voice_store(settings.voice_store, tmp_path, engine=None), PgVoiceStore)
        assert svc["depends_on"][pg_name]["condition"] == "service_healthy"
        assert settings.host == "0.0.0.0" and settings.port == 8080 and settings.engine.device == "cuda"
        assert "/health" in " ".join(svc["healthcheck"]["test"])
        assert svc.get("restart") == "unless-stopped"
    assert Settings().voice_store == "sqlite"  # the embedded default stays the default


# ------------------------------------------------------------------ nginx
def test_nginx_balances_every_replica_with_least_conn_and_passive_health(cluster, nginx: Block) -> None:
    lb = lb_service(cluster)
    mount = next(v for v in lb["volumes"] if v.endswith("/etc/nginx/nginx.conf:ro"))
    assert (ROOT / mount.split(":")[0]).resolve() == (ROOT / "deploy" / "nginx.conf").resolve()
    assert set(lb["depends_on"]) >= set(replicas(cluster))

    (http,) = nginx.blocks("http")
    (upstream,) = http.blocks("upstream")
    assert upstream.values("least_conn") == [[]]
    servers = upstream.values("server")
    targets = {args[0] for args in servers}
    assert targets == {f"{name}:8080" for name in replicas(cluster)}, "upstream and compose replicas differ"
    for args in servers:
        params = dict(a.split("=", 1) if "=" in a else (a, "") for a in args[1:])
        assert int(params["max_fails"]) >= 1 and seconds(params["fail_timeout"]) > 0
        if "resolve" in params:  # re-resolution needs shared memory and a resolver
            assert upstream.values("zone") and http.values("resolver")

    (server,) = http.blocks("server")
    assert server.one("listen") == [lb["ports"][0].split(":")[1]]
    upstream_url = f"http://{upstream.args[0]}"

    def effective(loc: Block, name: str) -> list[list[str]]:
        return loc.values(name) or server.values(name)  # nginx inherits when a level sets none

    locations = {b.args[-1]: b for b in server.blocks("location")}
    ws = locations["/v1/tts/stream"]
    assert ws.one("proxy_pass") == [upstream_url]
    assert ["1.1"] in effective(ws, "proxy_http_version")
    headers = {args[0].lower(): args[1] for args in effective(ws, "proxy_set_header")}
    assert headers["upgrade"] == "$http_upgrade"
    # `Connection` must carry "upgrade" for handshakes: via the map on $http_upgrade.
    conn = headers["connection"]
    if conn.startswith("$"):
        (mapping,) = [b for b in http.blocks("map") if b.args == ["$http_upgrade", conn]]
        assert ["upgrade"] in [args for name, args in mapping.directives if name == "default"]
    else:
        assert conn.lower() == "upgrade"
    assert seconds(effective(ws, "proxy_read_timeout")[0][0]) >= 600  # quiet sessions stay open
    assert locations["/"].one("proxy_pass") == [upstream_url]
    # Streamed audio must not wait in a proxy buffer.
    for loc in (ws, locations["/"]):
        assert effective(loc, "proxy_buffering") == [["off"]]
    # Retry a failed plain request on the other replica.
    nxt = effective(locations["/"], "proxy_next_upstream")[0]
    assert "error" in nxt and "http_503" in nxt


def test_nginx_accepts_the_largest_voice_upload(nginx: Block) -> None:
    limits = Settings().voices
    (http,) = nginx.blocks("http")
    (server,) = http.blocks("server")
    body = size_bytes((server.values("client_max_body_size") or http.values("client_max_body_size"))[0][0])
    # A JSON registration carries the audio as base64 (4/3) plus the other fields.
    assert body >= limits.max_upload_bytes * 4 // 3 + 64 * 1024


def test_nginx_parser_rejects_broken_configs() -> None:
    with pytest.raises(AssertionError):
        parse_nginx("http { server { listen 80; }")
    with pytest.raises(AssertionError):
        parse_nginx("http { listen 80 }")
    parsed = parse_nginx("events {} http { upstream u { least_conn; server a:1 max_fails=1; } }")
    assert parsed.blocks("http")[0].blocks("upstream")[0].values("least_conn") == [[]]
