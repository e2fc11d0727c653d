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
