"""A throwaway single-member etcd server for tests and benchmarks (not the product: the agent's etcd client is
agent.etcd.etcd_backend)."""

from __future__ import annotations

import socket
import subprocess
import time

from agent.etcd.etcd_backend import parse_endpoint
from chaos.localcluster import free_ports


class EtcdProcess:
    """A single-member etcd on loopback ports with its own data dir; `stop()` kills it, `start()` starts it again
    on the same ports and data (a restart keeps what was committed). `ports`: (client, peer), free ones by
    default; `start=False` leaves it stopped, so that clients can be started first."""

    def __init__(self, binary: str, data_dir: str, ports: tuple[int, int] | None = None, start: bool = True) -> None:
        client_port, peer_port = free_ports(2) if ports is None else ports
        self.endpoint = f"127.0.0.1:{client_port}"
        client, peer = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
        self.argv = [binary, "--name", "emoe-test", "--data-dir", data_dir, "--listen-client-urls", client,
                     "--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls",
                     peer, "--initial-cluster", f"emoe-test={peer}", "--log-level", "error"]
        self.proc: subprocess.Popen[bytes] | None = None
        if start:
            self.start()

    def start(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"etcd already runs on {self.endpoint}")
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def wait_ready(self, timeout: float = 20.0) -> None:
        if self.proc is None:
            raise RuntimeError(f"etcd on {self.endpoint} was not started")
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
        """kill -9 (what a crash does), then reap it."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
