"""A throwaway single-member etcd server for tests and benchmarks (not the product: the agent's etcd client is
agent.etcd_backend)."""

from __future__ import annotations

import socket
import subprocess
import time

from agent.etcd_backend import parse_endpoint
from chaos.localcluster import free_ports


class EtcdProcess:
    """A single-member etcd on free loopback ports with its own data dir; `stop()` kills it."""

    def __init__(self, binary: str, data_dir: str) -> None:
        ports = free_ports(2)
        self.endpoint = f"127.0.0.1:{ports[0]}"
        client, peer = f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}"
        self.proc = subprocess.Popen(
            [binary, "--name", "emoe-test", "--data-dir", data_dir, "--listen-client-urls", client,
             "--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"emoe-test={peer}", "--log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        host, port = parse_endpoint(self.endpoint)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode} before serving {self.endpoint}")
            try:
                with socket.create_connection((host, port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise TimeoutError(f"etcd not serving {self.endpoint} after {timeout} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
