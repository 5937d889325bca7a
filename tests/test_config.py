from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from agent.config import ConfigError, from_dict, load

ROOT = Path(__file__).resolve().parent.parent


def test_profiles_fill_defaults_and_fields_override() -> None:
    cfg = from_dict({"node_id": "n1", "profile": "test", "gossip": {"fanout": 5}})
    assert cfg.gossip.interval_ms == 50  # from the test profile
    assert cfg.gossip.fanout == 5  # from the file
    assert from_dict({"node_id": "n1"}).gossip.interval_ms == 200  # lan


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"node_id": "n", "gossip": {"interval_ms": "fast"}}, "gossip.interval_ms"),
        ({"node_id": "n", "gossip": {"interval_ms": 0}}, "gossip.interval_ms = 0"),
        ({"node_id": "n", "cluster": {"experts": 1000}}, "cluster.experts = 1000"),
        ({"node_id": "n", "listen": "nowhere"}, "listen = 'nowhere'"),
        ({"node_id": "n", "seeds": ["a:1"]}, "seeds[0]"),
        ({"node_id": "n", "profile": "wan"}, "profile = 'wan'"),
        ({"node_id": "n", "decision": {"theta": 0.5}}, "decision.theta = 0.5"),
        ({"node_id": "n", "bogus": 1}, "bogus"),
        ({"node_id": "n", "consensus": {"backend": "etcd"}}, "consensus.etcd_endpoints"),
        ({}, "node_id"),
    ],
)
def test_errors_name_field_and_value(raw: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError) as ei:
        from_dict(raw)
    assert needle in str(ei.value)


def test_config_is_frozen() -> None:
    cfg = from_dict({"node_id": "n"})
    with pytest.raises(AttributeError):
        cfg.node_id = "m"  # type: ignore[misc]


def test_load_names_file(tmp_path: Path) -> None:
    p = tmp_path / "bad.toml"
    p.write_text('node_id = "x"\n[gossip]\nfanout = -1\n')
    with pytest.raises(ConfigError, match=r"bad.toml: gossip.fanout = -1"):
        load(p)
    with pytest.raises(ConfigError, match="not valid TOML"):
        p.write_text("node_id = ")
        load(p)


@pytest.mark.parametrize("path", sorted((ROOT / "deploy" / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_deploy_configs_pass_check(path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "agent.cli", "agent", "--config", str(path), "--check"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert ": ok" in r.stdout


def test_check_rejects_bad_config(tmp_path: Path) -> None:
    p = tmp_path / "bad.toml"
    p.write_text('node_id = "x"\nlisten = "127.0.0.1:99999"\n')
    r = subprocess.run([sys.executable, "-m", "agent.cli", "agent", "--config", str(p), "--check"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "listen = '127.0.0.1:99999'" in r.stderr


def test_advertise_address() -> None:
    seeds = ["n1@10.0.0.1:7400", "n2@10.0.0.2:7400"]
    assert from_dict({"node_id": "n1", "listen": "0.0.0.0:7400", "seeds": seeds}).advertise_address == "10.0.0.1:7400"
    assert from_dict({"node_id": "n1", "listen": "127.0.0.1:7400"}).advertise_address == "127.0.0.1:7400"
    cfg = from_dict({"node_id": "n1", "listen": "0.0.0.0:7400", "advertise": "host1:7400"})
    assert cfg.advertise_address == "host1:7400"
    with pytest.raises(ConfigError, match="advertise = '0.0.0.0:7400'"):
        from_dict({"node_id": "n1", "advertise": "0.0.0.0:7400"})
