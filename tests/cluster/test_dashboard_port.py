"""local_cluster keeps Dask's default dashboard address (":8787"); when that port is taken Dask
serves it on a free one, and the printed link names the port it really has.

The clusters here ask for a port this test picked, not 8787 itself: other test processes
(pytest-xdist) start clusters that take 8787 and give it back at any moment."""
from __future__ import annotations

import socket

import pytest

from batchgen.cluster import client as client_module
from batchgen.cluster.client import DASHBOARD_ADDRESS, local_cluster


def _link_port(out: str) -> int:
    line = next(line for line in out.splitlines() if "dashboard at" in line)
    return int(line.rsplit(":", 1)[1].split("/")[0])


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("0.0.0.0", 0))
        return int(probe.getsockname()[1])


@pytest.mark.timeout(120)
def test_the_default_address_is_dasks() -> None:
    """Unpatched, local_cluster asks Dask for ":8787" (whoever holds that port right now)."""
    assert DASHBOARD_ADDRESS == ":8787"
    cluster = local_cluster(1, processes=False)
    try:
        assert cluster.scheduler_spec["options"]["dashboard_address"] == ":8787"
    finally:
        cluster.close()


@pytest.mark.timeout(120)
def test_dashboard_on_the_next_free_port_when_its_own_is_taken(capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = socket.socket()
    blocker.bind(("0.0.0.0", 0))
    blocker.listen()
    taken = int(blocker.getsockname()[1])
    monkeypatch.setattr(client_module, "DASHBOARD_ADDRESS", f":{taken}")
    try:
        cluster = local_cluster(1, processes=False)
        try:
            assert cluster.scheduler_spec["options"]["dashboard_address"] == f":{taken}"
            port = cluster.scheduler.http_server.port
            assert port != taken
            assert _link_port(capsys.readouterr().err) == port
        finally:
            cluster.close()
    finally:
        blocker.close()


@pytest.mark.timeout(120)
def test_dashboard_gets_its_port_when_free(capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    port = _free_port()
    monkeypatch.setattr(client_module, "DASHBOARD_ADDRESS", f":{port}")
    cluster = local_cluster(1, processes=False)
    try:
        assert cluster.scheduler.http_server.port == port
        assert _link_port(capsys.readouterr().err) == port
    finally:
        cluster.close()
