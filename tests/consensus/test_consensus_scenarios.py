"""Scenario files for the quorum commit (tests/scenarios/consensus/*.txt), etcd-raft datadriven style.

Each block is a command line, `----`, then the expected output, blocks separated by a blank line.
The format, and `EMOE_REWRITE=1` to rewrite the expected outputs: tests/datadriven.py.

Commands: cluster nodes=N voters=M seed=S [timeout_ms=50] [sync_ms=0] | propose NODE as=LABEL |
tick 100ms | run-until-accepted v=V count=K | partition A B | C D | heal | crash NODE [torn] |
restart NODE | outcomes | heads | log NODE | accepted v=V | check
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.config import ConsensusConfig
from chaos.checkers import check
from chaos.quorumsim import QuorumSim
from tests.datadriven import check_file

DIR = Path(__file__).resolve().parents[1] / "scenarios" / "consensus"
FILES = sorted(DIR.glob("*.txt"))


class Driver:
    def __init__(self) -> None:
        self.c: QuorumSim | None = None
        self.labels: dict[bytes, str] = {}
        self.seen_outcomes = 0

    @property
    def cl(self) -> QuorumSim:
        if self.c is None:
            raise ValueError("no cluster: the first command must be `cluster`")
        return self.c

    def name(self, digest: bytes) -> str:
        return self.labels.get(digest, digest.hex()[:8])

    def run(self, line: str) -> str:
        cmd, *args = line.split()
        kw = dict(a.split("=", 1) for a in args if "=" in a)
        pos = [a for a in args if "=" not in a]
        return getattr(self, "do_" + cmd.replace("-", "_"))(pos, kw)

    def do_cluster(self, pos: list[str], kw: dict[str, str]) -> str:
        cfg = ConsensusConfig(accept_timeout_ms=int(kw.get("timeout_ms", 50)), sync_interval_ms=int(kw.get("sync_ms", 0)))
        self.c = QuorumSim(int(kw["nodes"]), int(kw["voters"]), int(kw.get("seed", 1)), cfg)
        return "voters: " + " ".join(self.c.voters)

    def do_propose(self, pos: list[str], kw: dict[str, str]) -> str:
        from chaos.quorumsim import successor_table

        node = self.cl.nodes[pos[0]]
        t = successor_table(node.head, self.cl.rng)
        self.labels[t.digest] = kw.get("as", t.digest.hex()[:8])
        self.cl.propose(pos[0], t)
        return ""

    def do_tick(self, pos: list[str], kw: dict[str, str]) -> str:
        d = pos[0]
        secs = float(d[:-2]) / 1000 if d.endswith("ms") else float(d.rstrip("s"))
        self.cl.run(secs)
        return ""

    def do_run_until_accepted(self, pos: list[str], kw: dict[str, str]) -> str:
        v, want = int(kw["v"]), int(kw["count"])
        for _ in range(10_000):
            n = sum(1 for x in self.cl.voters if x in self.cl.up() and self.cl.nodes[x].acceptor.accepted(v)[1] is not None)
            if n >= want:
                return f"{n} voters accepted version {v}"
            self.cl.run(0.0001)
        return f"only {n} voters accepted version {v}"

    def do_partition(self, pos: list[str], kw: dict[str, str]) -> str:
        groups: list[list[str]] = [[]]
        for a in pos:
            if a == "|":
                groups.append([])
            else:
                groups[-1].append(a)
        self.cl.net.partition(groups)
        return ""

    def do_heal(self, pos: list[str], kw: dict[str, str]) -> str:
        self.cl.net.heal()
        return ""

    def do_crash(self, pos: list[str], kw: dict[str, str]) -> str:
        self.cl.crash(pos[0], tear="torn" in pos)
        return ""

    def do_restart(self, pos: list[str], kw: dict[str, str]) -> str:
        self.cl.restart(pos[0])
        return f"{pos[0]} recovered head {self.cl.nodes[pos[0]].head.version}"

    def do_outcomes(self, pos: list[str], kw: dict[str, str]) -> str:
        lines = []
        for n, o in self.cl.outcomes[self.seen_outcomes:]:
            votes = ",".join(v.voter + ("+" if v.accept else "-") for v in o.votes)
            status = "committed" if o.committed else f"not committed: {o.reason.split(';')[0]}"
            lines.append(f"{n} v{o.version} {status} votes={votes}")
        self.seen_outcomes = len(self.cl.outcomes)
        return "\n".join(lines)

    def do_heads(self, pos: list[str], kw: dict[str, str]) -> str:
        return " ".join(f"{n}={'down' if n in self.cl.down else self.cl.nodes[n].head.version}" for n in self.cl.ids)

    def do_log(self, pos: list[str], kw: dict[str, str]) -> str:
        node = self.cl.nodes[pos[0]]
        return " ".join(f"v{c.table.version}={self.name(c.qc.table_hash)}" for c in node.commits_since(0))

    def do_accepted(self, pos: list[str], kw: dict[str, str]) -> str:
        v = int(kw["v"])
        out = []
        for x in self.cl.voters:
            b, p = self.cl.nodes[x].acceptor.accepted(v)
            if p is not None:
                out.append(f"{x}:{self.name(p.table.content_hash)}@({b[0]},{b[1]})")
        return " ".join(out) or "none"

    def do_check(self, pos: list[str], kw: dict[str, str]) -> str:
        bad = check(self.cl.history)
        return "violations: " + (str(len(bad)) if not bad else "\n".join(bad))


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_scenario(path: Path) -> None:
    check_file(path, Driver().run)


def test_scenario_files_exist() -> None:
    assert {"dueling", "proposer_crash", "minority_partition", "crash_restart"} <= {p.stem for p in FILES}
