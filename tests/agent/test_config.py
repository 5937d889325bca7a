from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from agent.cli import main
from agent.config import ConfigError, from_dict, load
from agent.security import write_dev_certs

ROOT = Path(__file__).resolve().parents[2]
SEEDS = ["a@127.0.0.1:7401", "b@127.0.0.1:7402", "c@127.0.0.1:7403"]


def on_this_host(path: Path, tmp: Path) -> Path:
    """A copy of the deploy config `path` whose data_dir and tls.cert_dir (with development certificates for
    its node) are under `tmp`: what an operator provides on the host before `--check`."""
    text = path.read_text()
    raw = tomllib.loads(text)
    text = re.sub(r"^data_dir = .*$", f'data_dir = "{tmp / "data"}"', text, flags=re.M)
    if raw.get("tls", {}).get("cert_dir"):
        write_dev_certs(tmp / "tls", [raw["node_id"]])
        text = re.sub(r"^cert_dir = .*$", f'cert_dir = "{tmp / "tls"}"', text, flags=re.M)
    out = tmp / path.name
    out.write_text(text)
    return out


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
        # issue 17 item 8: each of these was accepted by --check
        ({"node_id": "a", "seeds": [SEEDS[0], "a@127.0.0.1:7409"], "cluster": {"nodes": 3}},
         "seeds[1] = 'a@127.0.0.1:7409': expected each node id once"),
        ({"node_id": "a", "seeds": [SEEDS[0], "b@127.0.0.1:7401"], "cluster": {"nodes": 3}}, "each address once"),
        ({"node_id": "a", "seeds": SEEDS, "cluster": {"nodes": 2}}, "seeds[2] = 'c@127.0.0.1:7403': expected at most"),
        ({"node_id": "a", "seeds": SEEDS, "cluster": {"nodes": 3}, "consensus": {"voters": ["a", "b", "a"]}},
         "consensus.voters[2] = 'a': expected a node id listed once"),
        ({"node_id": "a", "seeds": SEEDS, "cluster": {"nodes": 3}, "consensus": {"voters": ["a", "b", "d"]}},
         "consensus.voters[2] = 'd': expected one of the seeds' node ids"),
        ({"node_id": "a", "seeds": SEEDS[:2], "cluster": {"nodes": 3}, "consensus": {"voters": ["a", "x", "y"]}},
         "consensus.voters[2] = 'y'"),
        ({"node_id": "z", "seeds": SEEDS, "cluster": {"nodes": 3}}, "node_id = 'z': expected one of the seeds'"),
        ({"node_id": " "}, "node_id = ' '"),
        ({"node_id": "a b"}, "node_id = 'a b'"),
        ({"node_id": ""}, "node_id = ''"),
        ({"node_id": "a", "seeds": [" @127.0.0.1:7401"]}, "seeds[0] = ' @127.0.0.1:7401'"),
        ({"node_id": "a", "consensus": {"voters": [" "]}}, "consensus.voters[0] = ' '"),
        ({"node_id": "n", "decision": {"theta": float("inf")}}, "decision.theta = inf: expected a finite number"),
        ({"node_id": "n", "decision": {"theta": float("nan")}}, "decision.theta = nan: expected a finite number"),
        ({"node_id": "n", "decision": {"tau": float("nan")}}, "decision.tau = nan"),
        ({"node_id": "n", "decision": {"planner": "eplb"}}, "decision.planner = 'eplb': expected one of ['craft', "),
        ({"node_id": "n", "gossip": {"suspicion_mult": float("inf")}}, "gossip.suspicion_mult = inf"),
        ({"node_id": "n", "consensus": {"verify_tolerance": float("-inf")}}, "consensus.verify_tolerance = -inf"),
        ({"node_id": "n", "engine": {"install_lag_s": 0.0}}, "engine.install_lag_s = 0.0: expected seconds in"),
        ({"node_id": "n", "engine": {"install_lag_s": float("nan")}}, "engine.install_lag_s = nan"),
        ({"node_id": "n", "cluster": {"layers": 10**23}}, "cluster.layers = 100000000000000000000000: expected an "
                                                          "integer in 1..4096"),
        ({"node_id": "n", "cluster": {"experts": 2**40}}, "cluster.experts = 1099511627776"),
        ({"node_id": "n", "cluster": {"nodes": 10**9}}, "cluster.nodes = 1000000000"),
        ({"node_id": "n", "cluster": {"layers": 4096, "nodes": 64}}, "cluster.layers = 4096: expected a routing table"),
        ({"node_id": "n", "cluster": {"nodes": 4096, "ranks_per_node": 1024}}, "cluster.ranks_per_node = 1024"),
        ({"node_id": "n", "cluster": {"layers": 512, "experts": 1024, "nodes": 16, "slots_per_rank": 8}},
         "gossip.max_message_bytes = 1048576: expected >= one load window"),
        ({"node_id": "n", "gossip": {"interval_ms": 2**62}}, "gossip.interval_ms = 4611686018427387904"),
        ({"node_id": "n", "gossip": {"fanout": 10**6}}, "gossip.fanout = 1000000"),
        ({"node_id": "n", "gossip": {"max_message_bytes": 2**40}}, "gossip.max_message_bytes = 1099511627776"),
        ({"node_id": "n", "consensus": {"catchup_batch": 10**7}}, "consensus.catchup_batch = 10000000"),
        ({"node_id": "n", "consensus": {"accept_timeout_ms": 10**12}}, "consensus.accept_timeout_ms"),
        ({"node_id": "n", "decision": {"replay_windows": 10**6}}, "decision.replay_windows = 1000000"),
        ({"node_id": "n", "decision": {"replay_windows": 1000}, "gossip": {"max_message_bytes": 64 << 20},
          "cluster": {"layers": 256, "experts": 16384, "nodes": 256, "ranks_per_node": 8, "slots_per_rank": 8}},
         "decision.replay_windows = 1000: expected a replay buffer"),
        ({"node_id": "n", "ranks": [1, 1]}, "ranks[1] = 1: expected a rank listed once"),
        ({"node_id": "n", "metrics": {"listen": "localhost"}}, "metrics.listen = 'localhost'"),
        ({"node_id": "n", "metrics": {"listen": "127.0.0.1:7400"}}, "metrics.listen = '127.0.0.1:7400': expected an "
                                                                    "address other than listen"),
        ({"node_id": "n", "metrics": {"port": 9100}}, "port"),
        ({"node_id": "n", "decision": {"sample_every": -1}}, "decision.sample_every = -1"),
        ({"node_id": "n", "decision": {"polish_theta": 0.5}}, "decision.polish_theta = 0.5: expected a ratio >= 1.0"),
        ({"node_id": "n", "decision": {"polish_lam": -1.0}}, "decision.polish_lam = -1.0: expected a factor >= 0"),
        ({"node_id": "n", "decision": {"fast_theta": 0.9}}, "decision.fast_theta = 0.9: expected a ratio >= 1.0"),
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
def test_deploy_configs_pass_check(path: Path, tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "agent.cli", "agent", "--config", str(on_this_host(path, tmp_path)),
                        "--check"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert ": ok" in r.stdout
    assert not (tmp_path / "data").exists(), "--check left the data_dir behind"


def test_check_rejects_bad_config(tmp_path: Path) -> None:
    p = tmp_path / "bad.toml"
    p.write_text('node_id = "x"\nlisten = "127.0.0.1:99999"\n')
    r = subprocess.run([sys.executable, "-m", "agent.cli", "agent", "--config", str(p), "--check"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "listen = '127.0.0.1:99999'" in r.stderr


def check(tmp_path: Path, capsys: pytest.CaptureFixture[str], body: str, *, start: bool = False) -> tuple[int, str]:
    """`emoe agent --config F --check` (or a start with `start`) in process: (exit status, stderr)."""
    p = tmp_path / "agent.toml"
    p.write_text(body)
    rc = main(["agent", "--config", str(p), *([] if start else ["--check"])])
    return rc, capsys.readouterr().err


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("toml, needle", [
    ('node_id = "n"\nseeds = ["a@127.0.0.1:1", "a@127.0.0.1:2"]\n[cluster]\nnodes = 3\n', "seeds[1]"),
    ('node_id = "n"\n[decision]\ntheta = inf\n', "decision.theta = inf"),
    ('node_id = "n"\n[decision]\ntheta = nan\n', "decision.theta = nan"),
    ('node_id = "n"\n[cluster]\nlayers = 100000000000000000000000\n', "cluster.layers = 1000000"),
    ('node_id = "n"\n[cluster]\nlayers = 1e23\n', "cluster.layers"),
    ('node_id = " "\n', "node_id = ' '"),
])
def test_check_is_one_line_for_bad_values(tmp_path: Path, capsys: pytest.CaptureFixture[str], toml: str,
                                          needle: str) -> None:
    rc, err = check(tmp_path, capsys, f'data_dir = "{tmp_path / "d"}"\n' + toml)
    assert rc == 2 and needle in one_line(err)


def test_check_names_a_genesis_the_engine_side_cannot_build(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The placement spec is judged by the engine side's genesis_table, and the line names the field and its words."""
    rc, err = check(tmp_path, capsys, f'node_id = "n"\ndata_dir = "{tmp_path / "d"}"\n[cluster]\ngenesis = "nope"\n')
    assert rc == 2 and one_line(err) == (
        f"emoe agent: invalid config: {tmp_path / 'agent.toml'}: cluster.genesis = 'nope': expected BAD_INPUT: "
        "genesis 'nope': expected one of ('static', 'vllm', 'sglang') or an existing placement file\n")
    assert not (tmp_path / "d").exists()


def test_every_command_that_reads_a_config_refuses_a_genesis_the_engine_side_cannot_build(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The genesis check left agent.config (the consensus core reaches nothing of the engine side), and every
    command that reads an agent's config still runs it, as when it was part of loading: one line, exit 2,
    before anything is dialed or read."""
    from agent.cli import main

    cfg = tmp_path / "agent.toml"
    cfg.write_text(f'node_id = "n"\ndata_dir = "{tmp_path / "d"}"\n[cluster]\ngenesis = "nope"\n')
    said = (f"invalid config: {cfg}: cluster.genesis = 'nope': expected BAD_INPUT: genesis 'nope': expected one of "
            "('static', 'vllm', 'sglang') or an existing placement file")
    for argv in (["status", "--config", str(cfg)], ["store", "check", "--config", str(cfg)]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert said in one_line(err), (argv, err)
    assert not (tmp_path / "d").exists()


def test_check_tries_the_data_dir_and_leaves_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fresh = tmp_path / "new" / "deeper"
    rc, err = check(tmp_path, capsys, f'node_id = "n"\ndata_dir = "{fresh}"\n')
    assert rc == 0 and not (tmp_path / "new").exists(), err
    (tmp_path / "existing").mkdir()
    rc, err = check(tmp_path, capsys, f'node_id = "n"\ndata_dir = "{tmp_path / "existing"}"\n')
    assert rc == 0 and list((tmp_path / "existing").iterdir()) == [], err
    (tmp_path / "file").write_text("")
    rc, err = check(tmp_path, capsys, f'node_id = "n"\ndata_dir = "{tmp_path / "file" / "d"}"\n')
    assert rc == 2 and "data_dir = " in one_line(err) and "is not a directory" in err
    rc, err = check(tmp_path, capsys, 'node_id = "n"\ndata_dir = "/proc/emoe-data"\n')  # no entries can be made
    assert rc == 2 and "data_dir = '/proc/emoe-data': cannot be created" in one_line(err)


def test_unreadable_config_files_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "dir.toml").mkdir()
    (tmp_path / "binary.toml").write_bytes(b"node_id = \"\xff\xfe\"\n")
    for name, needle in (("dir.toml", "cannot read: Is a directory"), ("binary.toml", "not UTF-8 text"),
                         ("missing.toml", "no such file")):
        assert main(["agent", "--config", str(tmp_path / name), "--check"]) == 2
        assert needle in one_line(capsys.readouterr().err)


def test_check_refuses_a_data_dir_that_cannot_be_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A data_dir that exists as a directory but takes no new entry, for root too (root writes through
    directory permissions, so a mode-0500 directory cannot stand for one where CI runs as root): a directory
    removed while this process holds it open, reached through /proc/self/fd. Creating anything in it fails
    for every user; so does creating a data_dir below it."""
    gone = tmp_path / "gone"
    gone.mkdir()
    fd = os.open(gone, os.O_RDONLY | os.O_DIRECTORY)
    try:
        gone.rmdir()
        d = Path(f"/proc/self/fd/{fd}")
        assert d.is_dir()
        rc, err = check(tmp_path, capsys, f'node_id = "n"\ndata_dir = "{d}"\n')
        assert rc == 2 and "cannot be written" in one_line(err)
        rc, err = check(tmp_path, capsys, f'node_id = "n"\ndata_dir = "{d / "sub"}"\n')
        assert rc == 2 and f"cannot be created (cannot create entries in {d})" in one_line(err)
    finally:
        os.close(fd)


def test_check_needs_the_tls_files_of_this_node(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = f'node_id = "node1"\ndata_dir = "{tmp_path / "d"}"\n[tls]\n'
    rc, err = check(tmp_path, capsys, base + f'cert_dir = "{tmp_path / "missing"}"\n')
    assert rc == 2 and f"tls.cert_dir = '{tmp_path / 'missing'}': no such directory" in one_line(err)
    write_dev_certs(tmp_path / "tls", ["node2"])
    rc, err = check(tmp_path, capsys, base + f'cert_dir = "{tmp_path / "tls"}"\n')
    assert rc == 2 and "node1.pem: no such file" in one_line(err)
    (tmp_path / "tls" / "node1.pem").write_bytes((tmp_path / "tls" / "node2.pem").read_bytes())
    (tmp_path / "tls" / "node1-key.pem").write_bytes((tmp_path / "tls" / "node2-key.pem").read_bytes())
    rc, err = check(tmp_path, capsys, base + f'cert_dir = "{tmp_path / "tls"}"\n')
    assert rc == 2 and "issued to ['node2']" in one_line(err)
    write_dev_certs(tmp_path / "tls", ["node1"])
    rc, err = check(tmp_path, capsys, base + f'cert_dir = "{tmp_path / "tls"}"\n')
    assert rc == 0, err
    # starting (not only --check) refuses the same way, before anything binds: one line, no traceback
    rc, err = check(tmp_path, capsys, base + f'cert_dir = "{tmp_path / "missing"}"\n', start=True)
    assert rc == 2 and "tls.cert_dir" in one_line(err)


@pytest.mark.parametrize("listen", ["0.0.0.0:7400", "[::]:7400", "10.0.0.1:7400", "gpu-node-1:7400"])
def test_plaintext_off_loopback_needs_insecure(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               listen: str) -> None:
    base = f'node_id = "n"\nlisten = "{listen}"\ndata_dir = "{tmp_path / "d"}"\n'
    rc, err = check(tmp_path, capsys, base)
    assert rc == 2 and f"listen = '{listen}': plaintext on a non-loopback address" in one_line(err)
    assert "tls.insecure = true" in err
    rc, err = check(tmp_path, capsys, base + "[tls]\ninsecure = true\n")
    assert rc == 0 and "warning:" in one_line(err) and "tls.insecure = true" in err


@pytest.mark.parametrize("listen", ["127.0.0.1:7400", "127.0.0.2:7400", "[::1]:7400", "localhost:7400"])
def test_plaintext_on_loopback_is_fine(tmp_path: Path, capsys: pytest.CaptureFixture[str], listen: str) -> None:
    rc, err = check(tmp_path, capsys, f'node_id = "n"\nlisten = "{listen}"\ndata_dir = "{tmp_path / "d"}"\n')
    assert rc == 0 and err == ""


def test_lan_config_without_its_certificates_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The shipped LAN config uses TLS: on a host without its cert_dir, --check says so (it said "ok")."""
    text = re.sub(r"^data_dir = .*$", f'data_dir = "{tmp_path / "d"}"', (ROOT / "deploy/configs/lan.toml").read_text(),
                  flags=re.M)
    raw = tomllib.loads(text)
    assert raw["tls"]["cert_dir"] and not raw["tls"].get("insecure")
    rc, err = check(tmp_path, capsys, text.replace("/etc/emoe/tls", str(tmp_path / "none")))
    assert rc == 2 and "tls.cert_dir" in one_line(err)


def test_advertise_address() -> None:
    seeds = ["n1@10.0.0.1:7400", "n2@10.0.0.2:7400"]  # from_dict does not judge exposure: emoe agent does
    assert from_dict({"node_id": "n1", "listen": "0.0.0.0:7400", "seeds": seeds}).advertise_address == "10.0.0.1:7400"
    assert from_dict({"node_id": "n1", "listen": "127.0.0.1:7400"}).advertise_address == "127.0.0.1:7400"
    cfg = from_dict({"node_id": "n1", "listen": "0.0.0.0:7400", "advertise": "host1:7400"})
    assert cfg.advertise_address == "host1:7400"
    with pytest.raises(ConfigError, match="advertise = '0.0.0.0:7400'"):
        from_dict({"node_id": "n1", "advertise": "0.0.0.0:7400"})


def test_the_agent_plans_with_the_fast_theta_its_config_sets_never_below_theta() -> None:
    """decision.fast_theta reaches the decision core (agent.state.decision_params); a theta above it raises it,
    as before the setting existed (a config that sets only theta = 1.5 still starts)."""
    from agent.state import decision_params
    from controlplane.controller import DecisionParams

    assert decision_params(from_dict({"node_id": "n"})).fast_theta == DecisionParams.fast_theta
    assert decision_params(from_dict({"node_id": "n", "decision": {"fast_theta": 1.6}})).fast_theta == 1.6
    assert decision_params(from_dict({"node_id": "n", "decision": {"theta": 1.5}})).fast_theta == 1.5
    p = decision_params(from_dict({"node_id": "n", "decision": {"polish_lam": 2.0, "load_ms": 30.0}}))
    assert (p.polish_lam, p.load_ms) == (2.0, 30.0)  # and the rest of the section, as before



def test_check_warns_where_the_ids_sort_as_strings_apart_from_their_numbers(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With `ranks` unset a node owns the ranks of its place among the ids sorted as strings: node10 sorts
    second of node1..node12 and would own ranks 8-15, while its engine most likely runs 72-79."""
    def body(node: str, ids: list[str], extra: str = "") -> str:
        seeds = ", ".join(f'"{n}@127.0.0.1:{7401 + i}"' for i, n in enumerate(ids))
        return (f'node_id = "{node}"\ndata_dir = "{tmp_path / "d"}"\nseeds = [{seeds}]\n{extra}'
                f'[cluster]\nnodes = {len(ids)}\nranks_per_node = 8\nexperts = 256\n')

    plain = [f"node{i}" for i in range(1, 13)]
    rc, err = check(tmp_path, capsys, body("node10", plain))
    assert rc == 0 and "warning: node10 owns ranks 8-15" in err and "(ranks 72-79)" in err, err
    assert "node01, node02, ..., node10" in err and "`ranks`" in err
    for node, ids, extra in (("node1", plain, ""), ("node9", [f"node{i}" for i in range(1, 10)], ""),
                             ("node10", [f"node{i:02d}" for i in range(1, 13)], ""),
                             ("node10", plain, "ranks = [72, 73, 74, 75, 76, 77, 78, 79]\n")):
        rc, err = check(tmp_path, capsys, body(node, ids, extra))
        assert rc == 0 and "owns ranks" not in err, (node, ids[:2], extra, err)
