"""Agent configuration: frozen msgspec structs loaded from TOML, with named profiles.

A file names a `profile` (`lan`, `local` or `test`) whose defaults fill every section it leaves out;
fields it sets override them. Validation happens when the config is built: the error names the field,
the value and what was expected.
"""

from __future__ import annotations

import ipaddress
import math
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

import msgspec

from agent.configcheck import DAY_MS, ConfigError
from agent.configcheck import bounded as _bounded
from agent.configcheck import need as _need
from agent.gossip.claims import MAX_CERT_BYTES, MAX_SIGNATURE_BYTES
from agent.gossip.gossipconfig import GossipConfig
from agent.link.reportguard import DEFAULT_MAX_BATCH_TOKENS, MAX_BATCH_TOKENS
from controlplane.params import DecisionParams
from controlplane.planners import PLANNERS

__all__ = ["DAY_MS", "AgentConfig", "ClusterConfig", "ConfigError", "ConsensusConfig", "DecisionConfig", "EngineConfig",
           "GossipConfig", "TelemetryConfig", "TlsConfig", "from_dict", "is_loopback", "load"]


# shape bounds (the largest MoE models today: 61 layers, 384 experts, 8 of them per token)
MAX_NODES, MAX_RANKS_PER_NODE, MAX_SLOTS_PER_RANK = 4096, 1024, 1024
MAX_LAYERS, MAX_EXPERTS, MAX_TOP_K = 4096, 65536, 1024
MAX_RANKS = 65536                # nodes x ranks_per_node
MAX_EXPERT_BYTES = 1 << 40       # 1 TiB per expert
# one routing table (layers x slots int64) travels whole in a consensus Accept and a catch-up reply, under the
# agent's 64 MiB gRPC message limit; 32 MiB leaves room for the certificate and the plan beside it
MAX_TABLE_BYTES = 32 << 20
# a load window (layers x experts uint32) travels whole in a gossip message; this much is the envelope
WINDOW_ENVELOPE_BYTES = 2048
# the planner keeps decision.replay_windows windows in memory (DeepSeek-V3 shape: 59 KiB each)
MAX_REPLAY_BYTES = 1 << 30
# node ids are certificate names (`emoe certs`), DNS labels on Kubernetes, and keys in every message
NODE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")
NODE_ID_EXPECTED = "a name of letters, digits, '.', '_' or '-' (1 to 253, starting with a letter or digit)"


def _check_finite(section: str, obj: msgspec.Struct) -> None:
    """No NaN or infinity in any float field: every comparison with one is False, so a bound cannot catch it."""
    for f in obj.__struct_fields__:
        v = getattr(obj, f)
        if isinstance(v, float):
            _need(math.isfinite(v), f"{section}{f}", v, "a finite number")
        elif isinstance(v, msgspec.Struct):
            _check_finite(f"{section}{f}.", v)


def is_loopback(hostport: str) -> bool:
    """Whether 'host:port' names a loopback address (127.0.0.0/8, ::1 or localhost)."""
    host = hostport.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ClusterConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Shape of the decode pool and of the model."""

    nodes: int = 2
    ranks_per_node: int = 8
    slots_per_rank: int = 5
    layers: int = 26
    experts: int = 64
    top_k: int = 6
    expert_bytes: int = 3 * 2048 * 1408 * 2  # DeepSeek-V2-Lite expert: 3 bf16 matrices 2048x1408
    # The agents' version 1: the engine's boot placement (dataplane_shim.genesis.genesis_table): "static"
    # (blocks, spare slots empty: the reference engine), "vllm", "sglang" (both arange(P) % E), or a placement
    # file (.json/.pt SGLang --init-expert-location, .npz DeepSeek EPLB output) of [layers, P]. Every agent
    # of a cluster must say the same. Checked when the agent starts and by `emoe agent --check`
    # (agent.state.genesis_of builds it with the engine side's code), not here: the config, and the consensus
    # core that imports it, import nothing of dataplane_shim (tests/project/test_layering.py).
    genesis: str = "static"

    def validate(self) -> None:
        _bounded("cluster", self, {
            "nodes": (1, MAX_NODES), "ranks_per_node": (1, MAX_RANKS_PER_NODE), "slots_per_rank": (1, MAX_SLOTS_PER_RANK),
            "layers": (1, MAX_LAYERS), "experts": (1, MAX_EXPERTS), "top_k": (1, MAX_TOP_K),
            "expert_bytes": (1, MAX_EXPERT_BYTES)})
        ranks = self.nodes * self.ranks_per_node
        _need(ranks <= MAX_RANKS, "cluster.ranks_per_node", self.ranks_per_node,
              f"nodes x ranks_per_node <= {MAX_RANKS} (nodes = {self.nodes})")
        slots = ranks * self.slots_per_rank
        _need(self.experts <= slots, "cluster.experts", self.experts, f"<= nodes x ranks_per_node x slots_per_rank = {slots}")
        _need(self.top_k <= self.experts, "cluster.top_k", self.top_k, f"<= experts = {self.experts}")
        table = self.layers * slots * 8
        _need(table <= MAX_TABLE_BYTES, "cluster.layers", self.layers,
              f"a routing table of layers x {slots} slots x 8 bytes <= {MAX_TABLE_BYTES >> 20} MiB "
              f"(this one: {table / (1 << 20):.0f} MiB)")


class DecisionConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # the decision core's knobs; their defaults (and what each means) are controlplane.params.DecisionParams'
    window: int = DecisionParams.window
    theta: float = DecisionParams.theta
    budget_windows: int = DecisionParams.budget_windows
    tau: float = DecisionParams.tau
    rollback_windows: int = DecisionParams.rollback_windows
    max_ops: int = DecisionParams.max_ops
    replay_windows: int = DecisionParams.replay_windows
    # who proposes operations for the decision core to verify and gate (controlplane.planners): "greedy"
    # (incremental, widened on a large gap) or "craft" (CRAFT's per-layer replica knapsack, re-planned whole)
    planner: str = DecisionParams.planner
    # the engine plugins send the counts of every sample_every-th step besides the totals, and gossip carries
    # them to every voter's replay (0: totals only). It must equal the plugins' EMOE_SAMPLE_EVERY (a report
    # with another is used for its totals only, and a warning names both)
    sample_every: int = DecisionParams.sample_every
    # One live voter plans each window: the round-0 owner of the next version, handing over to the next
    # live voter in the rotation after this many windows without a new head (so a planner that is stuck,
    # cut off from a quorum, or finds nothing worth proposing yields). The others vote, replay and stand by;
    # a repair or due rollback is proposed by the planner at once and by the others a window later if nothing
    # committed (a rank whose process left: by its own node at once). 0: every node plans every window.
    handover_windows: int = 2
    # cost-benefit (controlplane.worth): the milliseconds of an engine step that grow with its busiest rank's
    # load (the step time minus a step with no routed tokens; 0: off, act only above theta). A plan is
    # proposed when its gain over horizon_windows windows repays its copies (1 + worth_margin) times, and under
    # theta a window is planned on when a perfect plan would gain tau (a refused attempt backs off).
    # Unset: the agents fit it from the engines' measured step times (controlplane.steptime), DecisionParams'
    # figure until enough are in; set: an override, used as it is (`emoe explain` says which)
    load_ms: float | None = None
    # the agents measure what each change's copies cost the steps they overlapped (from the versions the engines
    # say each step ran on: controlplane.copycost) and show it in `emoe explain`; true: the cost-benefit test
    # charges copies with that measure, not the cost model's figure alone (off: see DecisionParams)
    copy_cost_measured: bool = DecisionParams.copy_cost_measured
    horizon_windows: int = DecisionParams.horizon_windows
    worth_margin: float = DecisionParams.worth_margin
    # where the planner's one-at-a-time moves are stuck short of tau, it may still re-pack or exchange layers
    # when the load is polish_theta above an even split (0: never), each copied slot charged its serving time:
    # it must save polish_lam x (1 + worth_margin) times what it costs serving over the horizon (fewer bytes
    # with a larger polish_lam; controlplane.decision, DecisionParams.polish_charge)
    polish_theta: float = DecisionParams.polish_theta
    polish_lam: float = DecisionParams.polish_lam
    # a window this far above an even split spends the whole error budget at once (a drift is acted on one
    # window after it shows, not budget_windows), and lets the planner re-pack whole layers; never below theta
    # (a theta above it raises it to theta)
    fast_theta: float = DecisionParams.fast_theta

    def validate(self) -> None:
        # replay_windows keeps that many [layers, experts] windows in memory
        _bounded("decision", self, {"handover_windows": (0, 10_000), "window": (1, 1_000_000),
                                    "budget_windows": (1, 10_000), "rollback_windows": (1, 10_000),
                                    "max_ops": (1, 65_536), "replay_windows": (1, 1000),
                                    "horizon_windows": (1, 1_000_000)})
        _need(self.load_ms is None or 0.0 <= self.load_ms <= 1e6, "decision.load_ms", self.load_ms,
              "milliseconds >= 0 (0: no cost-benefit; unset: fitted from the engines' step times)")
        _need(0.0 <= self.worth_margin <= 1e6, "decision.worth_margin", self.worth_margin, "a ratio >= 0")
        _need(self.polish_theta == 0.0 or 1.0 <= self.polish_theta <= 1e6, "decision.polish_theta", self.polish_theta,
              "a ratio >= 1.0 (0: off)")
        _need(0.0 <= self.polish_lam <= 1e6, "decision.polish_lam", self.polish_lam, "a factor >= 0")
        _need(1.0 <= self.fast_theta <= 1e6, "decision.fast_theta", self.fast_theta, "a ratio >= 1.0")
        _need(self.theta >= 1.0, "decision.theta", self.theta, "a ratio >= 1.0")
        _need(0.0 <= self.tau < 1.0, "decision.tau", self.tau, "a fraction in [0, 1)")
        _need(self.planner in PLANNERS, "decision.planner", self.planner, f"one of {sorted(PLANNERS)}")
        _need(0 <= self.sample_every <= 1_000_000, "decision.sample_every", self.sample_every,
              "0 (no sampled steps) to 1000000 (a window without a sampled step is seen as its mean step)")


class ConsensusConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    backend: Literal["quorum", "etcd"] = "quorum"
    voters: list[str] = msgspec.field(default_factory=list)  # node ids; empty: the seed list's nodes
    accept_timeout_ms: int = 300     # takeover after this: several LAN RTTs plus an fsync
    verify_tolerance: float = 0.05   # a voter's replay may differ from the proposer's by this much
    etcd_endpoints: list[str] = msgspec.field(default_factory=list)
    # ballots one proposal tries (each after accept_timeout with jittered backoff) before it reports failure
    max_attempts: int = 4
    # commits per CatchUp reply: a DeepSeek-V3-shaped table (58 x 320 int64) is ~150 KiB, so 16 stay
    # under gRPC's default 4 MiB message limit
    catchup_batch: int = 16
    # anti-entropy: ask one random voter for newer commits this often (0 = only when a peer shows a higher head)
    sync_interval_ms: int = 1000
    # thrifty accepts: send to just enough voters for a quorum, the rest after this many ms (or at the first
    # refusal/failure). Fewer fsyncs and wake-ups per commit; 10 ms is ~10 LAN round trips plus an fsync.
    # 0 sends every accept at once.
    thrifty_ms: int = 10
    # compaction: when the log passes this size it is rewritten with the newest `log_retain` commits and the
    # open acceptor state. 64 MiB holds ~2000 commits of DeepSeek-V3-shaped tables; 1024 retained commits
    # let a peer that lags by up to 1024 versions catch up by CatchUp. 0 never compacts.
    log_compact_bytes: int = 64 << 20
    log_retain: int = 1024
    # after a failed write (disk full, I/O error) the node stops voting and checks the disk this often
    disk_retry_ms: int = 1000
    # "new": the voters are bootstrapping a new cluster, so an empty store may be a founding member's (it still
    # asks the others whether they knew it: agent/consensus/rebuild.py); "existing": the cluster exists, so
    # an empty store was lost, and the node rebuilds as a learner (etcd's initial-cluster-state)
    initial_cluster_state: Literal["new", "existing"] = "new"

    def validate(self) -> None:
        _bounded("consensus", self, {"accept_timeout_ms": (1, DAY_MS), "max_attempts": (1, 1000),
                                     "catchup_batch": (1, 1024), "sync_interval_ms": (0, DAY_MS),
                                     "thrifty_ms": (0, DAY_MS), "log_compact_bytes": (0, 1 << 40),
                                     "log_retain": (1, 1_000_000), "disk_retry_ms": (1, DAY_MS)})
        seen: dict[str, int] = {}
        for i, v in enumerate(self.voters):
            _need(bool(NODE_ID_RE.match(v)), f"consensus.voters[{i}]", v, NODE_ID_EXPECTED)
            _need(v not in seen, f"consensus.voters[{i}]", v, f"a node id listed once (also voters[{seen.get(v)}])")
            seen[v] = i
        _need(0.0 <= self.verify_tolerance <= 1.0, "consensus.verify_tolerance", self.verify_tolerance, "in [0, 1]")
        if self.backend == "etcd":
            _need(bool(self.etcd_endpoints), "consensus.etcd_endpoints", self.etcd_endpoints,
                  "at least one host:port when backend = 'etcd'")


class EngineConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The engine ranks beside this agent (their plugins report the version they run with every load report)."""

    # A rank whose installed version stays behind the committed head longer than this is flagged `lagging`
    # in `emoe status` (and logged). Why 10 s: a committed delta reaches the plugin in milliseconds; the EP
    # ranks agree on it within EMOE_AGREE_EVERY + 1 steps (the agreement is overlapped with one step: 33 at the
    # default 32); vLLM's async EPLB moves one layer per step, so a table that touches all 61 layers of
    # DeepSeek-V3 is in after ~61 more; the next report (EMOE_REPORT_EVERY = 25 steps) says so: ~120 decode
    # steps of ~30 ms, under 4 s. 10 s is twice that; an engine that rearranges the whole model synchronously
    # (seconds to tens of seconds per move) needs a larger bound.
    install_lag_s: float = 10.0
    # The largest batch (tokens in one step) a load report's counts may cover where the engine's plugin declares
    # none (LoadReport.max_batch_tokens; an older plugin): each expert's count per step at most this, a layer's at
    # most this x cluster.top_k (agent/link/reportguard.py). Why 2^24: SGLang's rank 0 reports its EP group's sum,
    # and 1024 ranks (128 nodes x 8) x 16,384 tokens a step is the most the design's largest group carries; a
    # count of 2^32 - 1 in a report of up to 255 steps is refused.
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS

    def validate(self) -> None:
        _need(0.1 <= self.install_lag_s <= 3600.0, "engine.install_lag_s", self.install_lag_s,
              "seconds in [0.1, 3600]")
        _need(1 <= self.max_batch_tokens <= MAX_BATCH_TOKENS, "engine.max_batch_tokens", self.max_batch_tokens,
              f"tokens in [1, {MAX_BATCH_TOKENS}]")


class TelemetryConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    enabled: bool = False  # the standard OTEL_* variables configure exporters when enabled


class MetricsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Prometheus metrics (agent/admin/metrics.py): `listen` HOST:PORT serves them at /metrics, plaintext (bind it
    to an address only the scraper reaches); empty, the default: off. `per_expert`: also the newest window's
    tokens per (layer, expert), layers x experts series (14,848 for DeepSeek-V3)."""

    listen: str = ""
    per_expert: bool = False

    def validate(self) -> None:
        if self.listen:
            _check_hostport("metrics.listen", self.listen)


class TlsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Mutual TLS for agent-to-agent and admin traffic (see agent/security.py, `emoe certs`)."""

    # directory with ca.pem, <node_id>.pem and <node_id>-key.pem; empty: plaintext (loopback/dev only)
    cert_dir: str = ""
    # client identities (certificate CN) allowed to make mutating admin calls (propose, drain, pause, ...)
    admins: list[str] = msgspec.field(default_factory=lambda: ["admin"])
    # a plaintext listener serving only grpc.health.v1, for probes that cannot present a client
    # certificate (Kubernetes gRPC probes); empty: none
    health_listen: str = ""
    # plaintext on a non-loopback `listen` is refused unless this is set (an isolated test network): then
    # anyone who reaches the port can join the cluster, vote and drain ranks, and every start warns so
    insecure: bool = False

    def validate(self) -> None:
        for i, a in enumerate(self.admins):
            ok = bool(a) and a == a.strip() and not any(c in a for c in ",@/ ")
            _need(ok, f"tls.admins[{i}]", a, "a certificate common name without spaces, ',', '@' or '/'")
        if self.health_listen:
            _check_hostport("tls.health_listen", self.health_listen)


class AgentConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    node_id: str
    listen: str = "127.0.0.1:7400"
    # host:port that other nodes dial; empty: `listen`, or this node's own seed entry when `listen` binds a
    # wildcard address (0.0.0.0 / [::]) that peers cannot dial
    advertise: str = ""
    seeds: list[str] = msgspec.field(default_factory=list)  # "node_id@host:port"
    data_dir: str = "./emoe-data"
    shim_socket: str = ""  # unix socket for the local shim; empty: <data_dir>/shim.sock
    profile: Literal["lan", "local", "test"] = "lan"
    ranks: list[int] = msgspec.field(default_factory=list)  # global ranks on this node; empty: by node index
    cluster: ClusterConfig = msgspec.field(default_factory=ClusterConfig)
    gossip: GossipConfig = msgspec.field(default_factory=GossipConfig)
    decision: DecisionConfig = msgspec.field(default_factory=DecisionConfig)
    consensus: ConsensusConfig = msgspec.field(default_factory=ConsensusConfig)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    telemetry: TelemetryConfig = msgspec.field(default_factory=TelemetryConfig)
    tls: TlsConfig = msgspec.field(default_factory=TlsConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)

    @property
    def shim_socket_path(self) -> str:
        """The unix socket the engine's plugins connect to: `shim_socket`, or `<data_dir>/shim.sock`."""
        return self.shim_socket or str(Path(self.data_dir) / "shim.sock")

    def validate(self) -> None:
        _check_finite("", self)
        _need(bool(NODE_ID_RE.match(self.node_id)), "node_id", self.node_id, NODE_ID_EXPECTED)
        _check_hostport("listen", self.listen)
        if self.advertise:
            _check_hostport("advertise", self.advertise)
            _need(not self.advertise.startswith(("0.0.0.0:", "[::]:")), "advertise", self.advertise,
                  "an address peers can dial, not a wildcard")
        self.cluster.validate()
        self._validate_members()
        self.gossip.validate()
        self.decision.validate()
        self.consensus.validate()
        self.engine.validate()
        self.tls.validate()
        self.metrics.validate()
        _need(self.metrics.listen not in (self.listen, self.tls.health_listen) or not self.metrics.listen,
              "metrics.listen", self.metrics.listen, "an address other than listen and tls.health_listen")
        _need(self.tls.health_listen != self.listen, "tls.health_listen", self.tls.health_listen,
              "an address other than listen")
        G = self.cluster.nodes * self.cluster.ranks_per_node
        for i, r in enumerate(self.ranks):
            _need(0 <= r < G, f"ranks[{i}]", r, f"a rank in 0..{G - 1}")
            _need(r not in self.ranks[:i], f"ranks[{i}]", r, "a rank listed once")
        c = self.cluster
        # under mTLS a window also carries its node's signature and certificate (agent/gossip/windowguard.py)
        proof = MAX_SIGNATURE_BYTES + MAX_CERT_BYTES if self.tls.cert_dir else 0
        window = c.layers * c.experts * 4 + WINDOW_ENVELOPE_BYTES + proof
        _need(window <= self.gossip.max_message_bytes, "gossip.max_message_bytes", self.gossip.max_message_bytes,
              f">= one load window of cluster.layers x cluster.experts x 4 bytes + {WINDOW_ENVELOPE_BYTES}"
              f"{f' + {proof} (its signature and certificate)' if proof else ''} = {window}")
        replay = self.decision.replay_windows * c.layers * c.experts * 4
        _need(replay <= MAX_REPLAY_BYTES, "decision.replay_windows", self.decision.replay_windows,
              f"a replay buffer of replay_windows x layers x experts x 4 bytes <= {MAX_REPLAY_BYTES >> 20} MiB "
              f"(this one: {replay / (1 << 20):.0f} MiB)")

    def _validate_members(self) -> None:
        """Seeds name distinct nodes at distinct addresses, no more than cluster.nodes; voters are nodes of the
        cluster. When the seeds name every node, each voter must be one of them; with fewer seeds the rest are
        found by gossip, and the seeds, the voters and this node together may name at most cluster.nodes."""
        ids: dict[str, int] = {}
        addrs: dict[str, int] = {}
        nodes = self.cluster.nodes
        for i, s in enumerate(self.seeds):
            node, sep, addr = s.partition("@")
            _need(bool(sep) and bool(node), f"seeds[{i}]", s, "'node_id@host:port'")
            _need(bool(NODE_ID_RE.match(node)), f"seeds[{i}]", s, f"a node id that is {NODE_ID_EXPECTED}")
            _check_hostport(f"seeds[{i}]", addr)
            _need(node not in ids, f"seeds[{i}]", s, f"each node id once (node {node!r} is also seeds[{ids.get(node)}])")
            _need(addr not in addrs, f"seeds[{i}]", s, f"each address once (also in seeds[{addrs.get(addr)}])")
            _need(i < nodes, f"seeds[{i}]", s, f"at most cluster.nodes = {nodes} seeds")
            ids[node], addrs[addr] = i, i
        complete = len(ids) == nodes
        known = set(ids)
        for i, v in enumerate(self.consensus.voters):
            _need(not complete or v in ids, f"consensus.voters[{i}]", v,
                  f"one of the seeds' node ids {sorted(ids)} (they name all cluster.nodes = {nodes})")
            known.add(v)
            _need(len(known) <= nodes, f"consensus.voters[{i}]", v,
                  f"a node of the cluster: seeds and voters would name more than cluster.nodes = {nodes}")
        _need(not complete or self.node_id in ids, "node_id", self.node_id,
              f"one of the seeds' node ids {sorted(ids)} (they name all cluster.nodes = {nodes})")
        _need(len(known | {self.node_id}) <= nodes, "node_id", self.node_id,
              f"a node of the cluster: seeds, voters and node_id would name more than cluster.nodes = {nodes}")

    @property
    def advertise_address(self) -> str:
        if self.advertise:
            return self.advertise
        if self.listen.startswith(("0.0.0.0:", "[::]:")):
            return self.seed_map.get(self.node_id, self.listen)
        return self.listen

    @property
    def seed_map(self) -> dict[str, str]:
        return dict(s.split("@", 1) for s in self.seeds)


def _check_hostport(field: str, value: str) -> None:
    host, sep, port = value.rpartition(":")
    ok = bool(sep) and bool(host) and port.isdigit() and 0 < int(port) < 65536
    _need(ok, field, value, "'host:port' with a port in 1..65535")


# Profiles: timing defaults for a datacenter LAN, for agents on one host, and for fast tests.
PROFILES: dict[str, dict[str, dict[str, Any]]] = {
    "lan": {},
    "local": {
        # one host: RTT ~0.1 ms and no wire to lose, so rumours and repair can run twice as often; the
        # engines share its CPUs, so probes keep the lan timeout (and the 2 s suspicion floor).
        "gossip": {"interval_ms": 100, "probe_interval_ms": 250, "probe_timeout_ms": 100,
                   "pushpull_interval_ms": 500, "reconnect_interval_ms": 1000},
        "consensus": {"accept_timeout_ms": 150},
    },
    "test": {
        # tests on a loaded 2-core box: short intervals, generous timeouts against CPU stalls (a probe may
        # wait 150 ms for a busy event loop; suspicion lasts >= 2 s, so a stalled process refutes in time)
        "gossip": {"interval_ms": 50, "probe_interval_ms": 200, "probe_timeout_ms": 150,
                   "pushpull_interval_ms": 500, "reconnect_interval_ms": 1000},
        "consensus": {"accept_timeout_ms": 500},
        "decision": {"window": 20, "budget_windows": 1},
    },
}


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def from_dict(raw: dict[str, Any]) -> AgentConfig:
    """Build and validate a config from a TOML-shaped dict, applying its profile's defaults first."""
    profile = raw.get("profile", "lan")
    if profile not in PROFILES:
        raise ConfigError(f"profile = {profile!r}: expected one of {sorted(PROFILES)}")
    merged = _merge(PROFILES[profile], raw)
    try:
        cfg = msgspec.convert(merged, AgentConfig)
    except msgspec.ValidationError as e:
        # msgspec says e.g. "Expected `int`, got `str` - at `$.gossip.interval_ms`"
        msg = str(e)
        where = msg.rsplit(" - at `$.", 1)
        if len(where) == 2:
            field = where[1].rstrip("`")
            raise ConfigError(f"{field}: {where[0]}") from None
        raise ConfigError(msg) from None
    cfg.validate()
    return cfg


def load(path: str | Path) -> AgentConfig:
    """Load a TOML file; errors name the file as well as the field."""
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such file") from None
    except OSError as e:  # a directory, no permission, an I/O error
        raise ConfigError(f"{p}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML: not UTF-8 text (byte {e.start})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from None
    try:
        return from_dict(raw)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None
