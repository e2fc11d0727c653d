import os
from pathlib import Path

import pytest
import yaml

from gateway.settings import Settings, _leaves, build_parser, load_settings

ROOT = Path(__file__).resolve().parent.parent


def test_defaults_then_yaml_then_env_then_flags(tmp_path):
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("port: 9001\nengine:\n  initial_hop: 20\nws: {}\n")
    s, _ = load_settings(["--config", str(cfg)], environ={})
    assert s.port == 9001 and s.engine.initial_hop == 20
    s, _ = load_settings(["--config", str(cfg)], environ={"COSYVOICE_GW_PORT": "9002"})
    assert s.port == 9002
    s, _ = load_settings(
        ["--config", str(cfg), "--port", "9003", "--engine.initial-hop", "5", "--api-keys", "a,b"],
        environ={"COSYVOICE_GW_PORT": "9002", "COSYVOICE_GW_ENGINE__INITIAL_HOP": "7"},
    )
    assert s.port == 9003 and s.engine.initial_hop == 5 and s.api_keys == ("a", "b")


def test_env_nested_and_bool(tmp_path):
    s, _ = load_settings(
        [],
        environ={"COSYVOICE_GW_ENGINE__WARMUP": "false", "COSYVOICE_GW_DATA_DIR": str(tmp_path)},
    )
    assert s.engine.warmup is False and s.data_dir == tmp_path


def test_unknown_options_are_errors(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("prot: 1\n")
    with pytest.raises(ValueError, match="unknown option 'prot'"):
        load_settings(["--config", str(cfg)], environ={})
    with pytest.raises(ValueError, match="COSYVOICE_GW_NOPE"):
        load_settings([], environ={"COSYVOICE_GW_NOPE": "1"})
    with pytest.raises(ValueError, match="expected int"):
        load_settings(["--port", "eighty"], environ={})
    for bad in ("0", "inf", "nan", "1e30", "0.000001"):
        with pytest.raises(ValueError, match="gil_switch_interval_ms must be within"):
            load_settings(["--gil-switch-interval-ms", bad], environ={})
    assert load_settings(["--gil-switch-interval-ms", "0.5"], environ={})[0].gil_switch_interval_ms == 0.5


def test_help_documents_every_option():
    text = build_parser().format_help()
    for path, _ in _leaves(Settings):
        flag = "--" + ".".join(p.replace("_", "-") for p in path)
        assert flag in text, flag
        env = "COSYVOICE_GW_" + "__".join(p.upper() for p in path)
        assert env in text.replace("\n", "").replace(" ", ""), env
    # A help text's literal percent stays one (argparse would read "% s" as a format).
    assert "option_strings" not in text and "11-12% slower" in " ".join(text.split())


def test_shipped_default_yaml_is_valid():
    s, _ = load_settings(["--config", str(ROOT / "config" / "default.yaml")], environ={})
    assert s.default_voice == "default"


def test_docker_compose_is_a_gpu_service_with_volume_and_health():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    svc = compose["services"]["gateway"]
    devices = svc["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert any(str(p).endswith(":8080") for p in svc["ports"])
    volume, target = svc["volumes"][0].split(":")
    assert volume in compose["volumes"] and target == svc["environment"]["COSYVOICE_GW_DATA_DIR"]
    assert "/health" in " ".join(svc["healthcheck"]["test"])
    assert "COSYVOICE_GW_MODEL" in svc["environment"]
    # every COSYVOICE_GW_* variable the compose file sets must be a real option
    s, _ = load_settings([], environ={k: str(v) for k, v in svc["environment"].items() if "${" not in str(v)})
    assert s.port == 8080
    assert (ROOT / svc.get("build", ".") / "Dockerfile").is_file()


@pytest.mark.parametrize("argv, message", [
    (["--port", "70000"], "port must be within"),
    (["--port", "-1"], "port must be within"),
    (["--log-level", "verbose"], "log_level must be one of"),
    (["--voice-store", "mysql://u:secret@h/db"], "voice_store must be 'sqlite' or a postgresql"),
    (["--engine.lm-backend", "vLLM"], "engine.lm_backend must be one of"),
    (["--engine.device", "gpu"], "engine.device: 'gpu' is not a device"),
    (["--engine.stage-devices", "cuda:0,cuda1"], "engine.stage_devices: 'cuda1' is not a device"),
    # torch refuses a leading zero, but only once the model had loaded
    (["--engine.device", "cuda:01"], "engine.device: 'cuda:01' is not a device"),
    (["--engine.devices", "cuda:00,cuda:1"], "engine.devices: 'cuda:00' is not a device"),
    (["--engine.devices", "cuda:0,cuda:1", "--engine.stage-devices", "cuda:2"],
     "engine.devices .* does not combine with engine.stage_devices"),
    (["--engine.vllm-gpu-memory-utilization", "35"], "vllm_gpu_memory_utilization must be within"),
    (["--engine.tokens-per-text-token", "0"], "tokens_per_text_token must be within"),
    (["--port", "8080.5"], "expected int"),
])
def test_bad_values_are_refused_before_the_model_loads(argv, message):
    """Refused by the settings themselves (exit 2 in `gateway.__main__`, before a download
    and a model load), not after a start that then fails like an engine would."""
    with pytest.raises(ValueError, match=message) as exc:
        load_settings(argv, environ={})
    assert "secret" not in str(exc.value)


def test_yaml_values_are_converted_strictly(tmp_path):
    cfg = tmp_path / "gw.yaml"
    for text, message in [("host:\n", "host: a value is needed"), ("data_dir:\n", "data_dir: a value is needed"),
                          ("port: 8080.9\n", "expected int"), ("port: true\n", "expected int"),
                          ("data_dir: [1]\n", "expected a path")]:
        cfg.write_text(text)
        with pytest.raises(ValueError, match=message):
            load_settings(["--config", str(cfg)], environ={})
    cfg.write_text("port: 8081.0\napi_keys: 123\nengine: {stage_devices: cuda:1, tokens_per_text_token: null}\n")
    s, _ = load_settings(["--config", str(cfg)], environ={})
    assert s.port == 8081 and s.api_keys == ("123",) and s.engine.stage_devices == ("cuda:1",)
    assert s.engine.tokens_per_text_token is None


def test_kubernetes_service_links_are_not_settings():
    """A Service named cosyvoice-gw gives its pods COSYVOICE_GW_SERVICE_HOST, a
    COSYVOICE_GW_PORT of tcp://..., and more: ignored, not 'unknown' or a bad port."""
    links = {"COSYVOICE_GW_SERVICE_HOST": "10.96.0.10", "COSYVOICE_GW_SERVICE_PORT": "8080",
             "COSYVOICE_GW_SERVICE_PORT_HTTP": "8080", "COSYVOICE_GW_PORT": "tcp://10.96.0.10:8080",
             "COSYVOICE_GW_PORT_8080_TCP": "tcp://10.96.0.10:8080", "COSYVOICE_GW_PORT_8080_TCP_ADDR": "10.96.0.10"}
    assert load_settings([], environ=links)[0].port == 8080
    assert load_settings([], environ={**links, "COSYVOICE_GW_PORT": "9000"})[0].port == 9000


def test_uvicorn_waits_briefly_after_the_drain_not_a_second_shutdown_timeout():
    """The drain already waited up to shutdown_timeout; uvicorn's own wait for open
    connections after it is short, so a stop fits an orchestrator's grace (compose: 40 s)."""
    from gateway.__main__ import AFTER_DRAIN_GRACE_S, server_config

    for timeout, expected in ((30.0, AFTER_DRAIN_GRACE_S), (2.0, 2.0)):
        settings = Settings(shutdown_timeout=timeout)
        assert server_config(None, settings).timeout_graceful_shutdown == expected
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    grace = compose["services"]["gateway"]["stop_grace_period"]
    assert float(grace.rstrip("s")) > Settings().shutdown_timeout + AFTER_DRAIN_GRACE_S


def test_device_names_torch_takes_are_accepted():
    from gateway.settings import EngineSettings

    for device in ("auto", "cpu", "cuda", "cuda:0", "cuda:10"):
        assert EngineSettings(device=device).device == device
    # One engine with stage copies, and one engine given as a one-device list, are layouts of their own.
    assert EngineSettings(devices=("cuda:0",), stage_devices=("cuda:0", "cuda:1")).stage_devices == ("cuda:0", "cuda:1")


@pytest.mark.parametrize("argv, message", [
    (["--engine.devices", "cuda,cuda:0", "--engine.lm-backend", "torch"], "a GPU may host only one engine"),
    (["--engine.device", "cuda:1", "--engine.lm-backend", "vllm"], "CUDA_VISIBLE_DEVICES=1"),
])
def test_a_bad_worker_layout_exits_before_the_download(monkeypatch, capsys, argv, message):
    """The pool's own checks (one engine per GPU, vLLM on the first visible GPU) run with the
    settings' (exit 2), not after the model's download and load."""
    import engine.hub
    import gateway.__main__ as entry

    def no_download(*args, **kwargs):
        raise AssertionError("the model was resolved (downloaded) before the layout was checked")

    monkeypatch.setattr(engine.hub, "resolve_model", no_download)
    monkeypatch.setattr(entry, "setup_logging", lambda *args: None)
    monkeypatch.setattr(entry.sys, "setswitchinterval", lambda *args: None)
    for key in [k for k in os.environ if k.startswith("COSYVOICE_GW_")]:
        monkeypatch.delenv(key)
    with pytest.raises(SystemExit) as exc:
        entry.main(["--config", str(ROOT / "config" / "default.yaml"), *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_the_gateways_engine_defaults_are_the_engines(tmp_path, monkeypatch):
    """A default lives in three places (`EngineConfig`, the gateway's `EngineSettings`,
    config/default.yaml): the engine the gateway builds from its defaults, with or without
    the shipped YAML, is configured exactly as `EngineConfig`'s defaults, so a default moved
    in one place and not the others fails here (round 52 moved `max_hop` and the graph
    limit)."""
    import dataclasses

    from engine.config import EngineConfig
    from gateway.app import engine_config

    want = EngineConfig(model_dir=tmp_path)
    monkeypatch.chdir(tmp_path)  # no config/default.yaml here: [] takes the dataclass defaults
    for argv in ([], ["--config", str(ROOT / "config" / "default.yaml")]):
        got = engine_config(load_settings(argv, environ={})[0], tmp_path)
        differ = [f.name for f in dataclasses.fields(EngineConfig) if getattr(got, f.name) != getattr(want, f.name)]
        assert differ == [], (argv, differ)


def test_a_start_that_fails_exits_1_not_the_engine_failure_status(monkeypatch, tmp_path):
    """A start that fails in the app's lifespan (a model that does not load, a voice store
    in use by another process or unreachable) is "never started": status 1. uvicorn exits
    such a start with its own STARTUP_FAILURE, 3, which is the status this gateway keeps
    for an engine that failed while serving (a supervisor's "restart me")."""
    import contextlib

    from starlette.applications import Starlette

    import engine.hub
    import gateway.__main__ as entry
    import gateway.app

    @contextlib.asynccontextmanager
    async def failing_start(app):
        raise RuntimeError("the voice store is in use by another process")
        yield  # pragma: no cover

    monkeypatch.setattr(engine.hub, "resolve_model", lambda name, cache: tmp_path)
    monkeypatch.setattr(gateway.app, "create_app", lambda settings: Starlette(lifespan=failing_start))
    monkeypatch.setattr(entry, "setup_logging", lambda *args: None)
    monkeypatch.setattr(entry.sys, "setswitchinterval", lambda *args: None)
    for key in [k for k in os.environ if k.startswith("COSYVOICE_GW_")]:
        monkeypatch.delenv(key)
    with pytest.raises(SystemExit) as exc:
        entry.main(["--config", str(ROOT / "config" / "default.yaml"), "--port", "0"])
    assert exc.value.code == 1


def test_a_layer_overrides_related_options_together(tmp_path):
    """Options checked against each other (voices.min_seconds <= max_seconds,
    engine.devices against engine.stage_devices) are checked once a layer (the YAML, the
    environment, the flags) has set them all, not one by one: a valid final pair was
    refused for its mix with the layer below (min from the flags, max still the YAML's)."""
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("voices:\n  max_seconds: 10\nengine:\n  devices: [cuda:0, cuda:1]\n  lm_backend: torch\n")
    env = {"COSYVOICE_GW_VOICES__MIN_SECONDS": "12", "COSYVOICE_GW_VOICES__MAX_SECONDS": "25"}
    s, _ = load_settings(["--config", str(cfg)], environ=env)
    assert (s.voices.min_seconds, s.voices.max_seconds) == (12.0, 25.0)
    s, _ = load_settings(["--config", str(cfg), "--voices.min-seconds", "12", "--voices.max-seconds", "25",
                          "--engine.devices", "", "--engine.stage-devices", "cuda:0,cuda:1"], environ={})
    assert (s.voices.min_seconds, s.voices.max_seconds) == (12.0, 25.0)
    assert s.engine.devices == () and s.engine.stage_devices == ("cuda:0", "cuda:1")
    cfg.write_text("voices: {max_seconds: 2.5, min_seconds: 2}\n")  # the default min (3) is over this max
    assert load_settings(["--config", str(cfg)], environ={})[0].voices.max_seconds == 2.5
    # A pair that is wrong in the end is still refused.
    with pytest.raises(ValueError, match="max_seconds .* must be >= voices.min_seconds"):
        load_settings(["--config", str(cfg), "--voices.min-seconds", "12"], environ={})


def test_kubernetes_links_of_any_cosyvoice_gw_service_are_not_settings():
    """Every Service of the namespace gives its variables, so one named `cosyvoice-gw-metrics`
    (or -internal, -h100...) gives COSYVOICE_GW_METRICS_SERVICE_HOST and the rest: ignored,
    as those of `cosyvoice-gw` are, not 'unknown' (which stopped every gateway's start)."""
    links = {"COSYVOICE_GW_METRICS_SERVICE_HOST": "10.96.0.11", "COSYVOICE_GW_METRICS_SERVICE_PORT": "9090",
             "COSYVOICE_GW_METRICS_SERVICE_PORT_HTTP": "9090", "COSYVOICE_GW_METRICS_PORT": "tcp://10.96.0.11:9090",
             "COSYVOICE_GW_METRICS_PORT_9090_TCP": "tcp://10.96.0.11:9090",
             "COSYVOICE_GW_METRICS_PORT_9090_TCP_PROTO": "tcp", "COSYVOICE_GW_METRICS_PORT_9090_TCP_PORT": "9090",
             "COSYVOICE_GW_METRICS_PORT_9090_TCP_ADDR": "10.96.0.11",
             "COSYVOICE_GW_H100_POOL_SERVICE_HOST": "10.96.0.12"}
    assert load_settings([], environ=links)[0].port == 8080
    # A misspelt setting is still refused, and a section's variable is never taken for a link.
    for typo in ("COSYVOICE_GW_METRICS_PORT", "COSYVOICE_GW_WS__MAX_PORT"):
        with pytest.raises(ValueError, match=typo):
            load_settings([], environ={typo: "9090"})


def test_print_config_masks_api_keys_and_database_passwords(capsys, monkeypatch):
    from gateway.__main__ import main

    monkeypatch.delenv("COSYVOICE_GW_API_KEYS", raising=False)
    main(["--print-config", "--api-keys", "k-alpha,k-beta", "--port", "18123",
          "--voice-store", "postgresql://gw:hunter2@db:5432/voices?password=hunter3"])
    out = capsys.readouterr().out
    assert "k-alpha" not in out and "k-beta" not in out and "hunter" not in out
    printed = yaml.safe_load(out)
    assert printed["api_keys"] == ["***", "***"]  # how many keys there are still shows
    assert printed["voice_store"] == "postgresql://gw:***@db:5432/voices?password=***"
    assert printed["port"] == 18123


def test_a_config_file_that_cannot_be_read_is_a_one_line_error(tmp_path, capsys):
    """`--config` of a missing file, a directory, bad YAML or bytes that are not UTF-8 ended
    the start with a traceback (FileNotFoundError, IsADirectoryError, a YAML scanner error),
    or a one-liner that did not name the file, instead of the one line and exit status 2
    that every other settings mistake gets."""
    from gateway.__main__ import main

    broken = tmp_path / "broken.yaml"
    broken.write_text("port: [\n")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe port: 1\n")
    for path in (tmp_path / "missing.yaml", tmp_path, broken, binary):
        with pytest.raises(ValueError, match=str(path)):
            load_settings(["--config", str(path)], environ={})
        with pytest.raises(SystemExit) as exit_:
            main(["--config", str(path), "--print-config"])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1, err
