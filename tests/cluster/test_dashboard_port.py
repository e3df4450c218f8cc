"""local_cluster keeps Dask's default dashboard address (":8787"); when that port is taken Dask
serves it on a free one, and the printed link names the port it really has."""
from __future__ import annotations

import socket

import pytest

from batchgen.cluster.client import DASHBOARD_ADDRESS, local_cluster


def _link_port(out: str) -> int:
    line = next(line for line in out.splitlines() if "dashboard at" in line)
    return int(line.rsplit(":", 1)[1].split("/")[0])


@pytest.mark.timeout(120)
def test_dashboard_on_dasks_default_port_or_the_next_free_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert DASHBOARD_ADDRESS == ":8787"
    blocker = socket.socket()
    try:
        blocker.bind(("0.0.0.0", 8787))
        blocker.listen()
    except OSError:  # someone else already serves 8787: the same situation
        pass
    try:
        cluster = local_cluster(1, processes=False)
        try:
            assert cluster.scheduler_spec["options"]["dashboard_address"] == ":8787"
            port = cluster.scheduler.http_server.port
            assert port != 8787
            assert _link_port(capsys.readouterr().err) == port
        finally:
            cluster.close()
    finally:
        blocker.close()


@pytest.mark.timeout(120)
def test_dashboard_gets_8787_when_free(capsys: pytest.CaptureFixture[str]) -> None:
    probe = socket.socket()
    try:
        probe.bind(("0.0.0.0", 8787))
    except OSError:
        pytest.skip("port 8787 is in use on this machine")
    finally:
        probe.close()
    cluster = local_cluster(1, processes=False)
    try:
        assert cluster.scheduler.http_server.port == 8787
        assert _link_port(capsys.readouterr().err) == 8787
    finally:
        cluster.close()
