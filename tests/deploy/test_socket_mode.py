"""The shim socket is group-writable (0660) in the data dir's group, so that an engine running as another user
of that group can connect (a socket left at the umask's srwxr-xr-x admits only its owner)."""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import warnings
from pathlib import Path

import pytest

from agent.link.shim_link import SOCKET_MODE, serve_unix, share_socket
from elasticmoe.v1 import consensus_pb2 as cpb


class _Idle:
    def head_version(self) -> int:
        return 1

    def commits_since(self, version: int) -> list[cpb.Commit]:
        return []

    async def wait_for_newer(self, version: int) -> None:
        import asyncio

        await asyncio.Event().wait()


ENGINE_UID = 65534  # nobody: a user other than the agent's


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.asyncio
async def test_socket_is_0660_in_the_data_dirs_group(tmp_path: Path) -> None:
    old = os.umask(0o022)  # what a service usually runs with: a socket would be srwxr-xr-x
    try:
        server = await serve_unix(str(tmp_path / "shim.sock"), _Idle(), lambda r: None)
    finally:
        os.umask(old)
    try:
        sock = tmp_path / "shim.sock"
        assert stat.S_ISSOCK(os.stat(sock).st_mode)
        assert _mode(sock) == SOCKET_MODE == 0o660
        assert os.stat(sock).st_gid == os.stat(tmp_path).st_gid
    finally:
        await server.stop(0)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving the directory another group and running as another user "
                                               "need root")
@pytest.mark.asyncio
async def test_an_engine_in_the_group_connects_and_others_do_not() -> None:
    """The data dir is given a group the agent's process is not in by default (as the hostPath's gid 10001, or
    systemd's emoe group); an engine process of another uid connects when it is in that group, not otherwise."""
    import asyncio
    import shutil
    import tempfile

    group = 10001
    base = Path(tempfile.mkdtemp(prefix="emoe-sock-"))  # not under pytest's tmp dirs: those are 0700
    os.chmod(base, 0o755)  # let the other user reach the data dir
    if any(not os.stat(p).st_mode & stat.S_IXOTH for p in base.parents):
        shutil.rmtree(base)
        pytest.skip(f"{base} is not reachable by other users")
    data = base / "data"
    data.mkdir(mode=0o750)
    os.chown(data, 0, group)
    sock = data / "shim.sock"
    server = await serve_unix(str(sock), _Idle(), lambda r: None, group=group)
    try:
        assert os.stat(sock).st_gid == group and _mode(sock) == 0o660

        def connect_as(gid: int) -> int:
            """0 if a process of uid ENGINE_UID and group `gid` (no other groups) connects, else its errno."""
            with warnings.catch_warnings():  # fork with threads alive: the child only connects, then _exits
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    os.setgroups([])
                    os.setgid(gid)
                    os.setuid(ENGINE_UID)
                    with socket.socket(socket.AF_UNIX) as s:
                        s.connect(str(sock))
                    code = 0
                except OSError as e:
                    code = e.errno or 1
                finally:
                    os._exit(code)
            return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

        assert await asyncio.to_thread(connect_as, group) == 0
        assert await asyncio.to_thread(connect_as, 65533) == errno.EACCES  # not in the group
    finally:
        await server.stop(0)
        shutil.rmtree(base)


def test_a_group_it_cannot_give_is_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    sock = tmp_path / "s"
    sock.touch()

    def refuse(path: str, uid: int, gid: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "chown", refuse)
    # (earlier tests in the same process may have configured logging: take this logger's warnings as they come)
    monkeypatch.setattr(logging.getLogger("agent.link.shim_link"), "disabled", False)
    caplog.set_level(logging.WARNING, logger="agent.link.shim_link")
    share_socket(str(sock), os.stat(sock).st_gid + 1)
    assert _mode(sock) == 0o660
    assert "cannot give it group" in caplog.text
