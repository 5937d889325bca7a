"""An agent process for the chaos harness: `emoe agent`, with the gRPC transport's drop hook reading a fault
file (chaos.faults), so that the runner can partition real agent processes on loopback where network
namespaces are unavailable. The product itself has only the hook (agent.transport.grpc `drops`).

    python -m chaos.agentproc --config AGENT.toml --faults FAULTS.json
"""

from __future__ import annotations

import argparse
import sys

from agent.config import ConfigError
from chaos.faults import FaultFile


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="the agent's TOML config")
    ap.add_argument("--faults", required=True, help="the fault file the runner rewrites (chaos.faults)")
    a = ap.parse_args(argv)
    from agent.state import load_checked

    try:
        cfg = load_checked(a.config)
    except ConfigError as e:
        print(f"chaos agent: invalid config: {e}", file=sys.stderr)
        return 2
    from agent.process import run_forever

    return run_forever(cfg, drops=FaultFile(a.faults, cfg.node_id).drops)


if __name__ == "__main__":
    sys.exit(main())
