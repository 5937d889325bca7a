"""Hypothesis fuzzes every RPC handler (chaos/fuzz.py): EMOE_FUZZ_EXAMPLES examples each (default 300) of
descriptor-random, mutated-valid and raw-bytes requests. No exception escapes but the typed refusal, every
refusal has a reason, and neither a refused request nor a query changes the handler's state."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest

from chaos.fuzz import FuzzFailure, check_one, default_examples, factories, fuzz, main
from chaos.fuzz_targets import ConsensusTarget, Target, Verdict
from elasticmoe.v1 import consensus_pb2 as pb

EXPECTED = {"Consensus/Prepare", "Consensus/Accept", "Consensus/Learn", "Consensus/CatchUp",
            "Consensus/ControlAccept", "Consensus/ControlLearn", "Admin/Propose",
            "Admin/Drain", "Admin/Restore", "Admin/Pause", "Admin/Resume", "Admin/Status", "Admin/Placement",
            "Admin/History", "Admin/Explain", "Admin/LoadView", "DataplaneLink/ReportLoad",
            "DataplaneLink/WatchTables", "Shim/OfferCommit", "Gossip/Probe", "Gossip/IndirectProbe", "Gossip/PushPull",
            "Gossip/Broadcast", "Gossip/Pull", "Gossip/Push"}


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


def test_every_rpc_has_a_target() -> None:
    assert EXPECTED <= set(factories())


@pytest.mark.parametrize("name", sorted(factories()))
def test_fuzz_rpc(name: str, loop: asyncio.AbstractEventLoop) -> None:
    t = factories()[name](loop)
    try:
        s = fuzz(t, default_examples(), raise_on_failure=True)
    finally:
        t.close()
    assert s.crashes == 0 and s.state_changes_on_reject == 0 and s.accepted_hostile == 0, s.failures
    assert s.examples >= default_examples() and s.rejected + s.accepted + s.undecodable == s.examples
    if not name.startswith(("Admin/Status", "Admin/History", "Admin/LoadView", "Admin/Pause", "Admin/Resume",
                            "Consensus/CatchUp", "DataplaneLink/WatchTables")):
        assert s.rejected > 0, f"{name}: the fuzzer never reached a refusal"


class _Leaky(Target):
    """A handler that refuses but changes state anyway: the harness must catch it (the check can fail)."""

    name, request = "Leaky/Call", pb.PrepareRequest

    def __init__(self, crash_after: int = 10**9) -> None:
        self.n, self.crash_after = 0, crash_after

    def seeds(self) -> list[pb.PrepareRequest]:
        return [pb.PrepareRequest(version=1)]

    def fresh(self) -> None:
        pass

    def snapshot(self) -> int:
        return self.n

    def call(self, req: object) -> Verdict:
        self.n += 1
        if self.n > self.crash_after:
            raise ValueError("boom")
        return Verdict(True, "refused")


def test_harness_detects_state_change_and_crash() -> None:
    t = _Leaky()
    with pytest.raises(FuzzFailure, match="state changed"):
        fuzz(t, 20, raise_on_failure=True)
    t = _Leaky(crash_after=0)
    from chaos.fuzz import FuzzStats

    s = FuzzStats()
    assert "crash: ValueError" in check_one(t, pb.PrepareRequest(), s) and s.crashes == 1


def test_harness_detects_refusal_without_reason() -> None:
    t = ConsensusTarget("Prepare")
    t.call = lambda req: Verdict(True, "")  # type: ignore[method-assign]
    from chaos.fuzz import FuzzStats

    s = FuzzStats()
    assert "without a reason" in check_one(t, pb.PrepareRequest(), s) and s.crashes == 1


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--examples", "20", "--only", "Consensus/Accept,Admin/Drain", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["examples_per_rpc"] == 20 and set(out["rpcs"]) == {"Consensus/Accept", "Admin/Drain"}
    for r in out["rpcs"].values():
        assert r["examples"] == 20 and r["crashes"] == 0 and r["state_changes_on_reject"] == 0


def test_examples_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMOE_FUZZ_EXAMPLES", "42")
    assert default_examples() == 42
    monkeypatch.setenv("EMOE_FUZZ_EXAMPLES", "zero")
    with pytest.raises(ValueError, match="EMOE_FUZZ_EXAMPLES"):
        default_examples()
