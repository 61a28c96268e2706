"""Every listener of every daemon (gcache-server, gcache-master, gcache-worker, gcache-router)
binds exactly the address it was given (issue 21, finding 8):
read back from /proc/net/tcp. And the README's "by hand" recipe on one host: three masters on
three loopback addresses with one set of ports all start and elect a leader."""

from __future__ import annotations

import socket
import subprocess

import pytest

from gcache.common.processes import free_port, stop_process, wait_listening
from gcache.tools.devcluster.local_masters import LocalMaster, wait_leader
from gcache.tools.devcluster.local_server import server_command
from tests.support.listeners import listening_addresses
from tests.support.serving_support import RouterProc, WorkerProc, start_all

pytestmark = pytest.mark.cluster

MASTER_HOSTS = ("127.0.91.11", "127.0.91.12", "127.0.91.13")


def port_free_on(hosts) -> int:
    """A port free on every one of `hosts` (loopback aliases: all of 127/8 is local)."""
    for _ in range(50):
        port = free_port()
        try:
            for host in hosts:
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            continue
        return port
    raise AssertionError("no port free on every host")


def test_gcache_server_binds_exactly_its_host(tmp_path):
    host = "127.0.91.7"
    data, admin, grpc = port_free_on([host]), port_free_on([host]), port_free_on([host])
    args = server_command(
        host=host, port=data, admin_port=admin, memory="8MiB", disk="0", data_dir=tmp_path / "node"
    ) + ["--grpc-port", str(grpc)]
    with open(tmp_path / "server.log", "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_listening(proc, data, 30, "gcache-server", host=host)
        wait_listening(proc, admin, 30, "gcache-server admin", host=host)
        wait_listening(proc, grpc, 30, "gcache-server grpc", host=host)
        assert listening_addresses(proc.pid) == {(host, data), (host, admin), (host, grpc)}
    finally:
        stop_process(proc)


def test_three_masters_on_one_host_share_their_ports_on_three_addresses(tmp_path):
    """gcache-master --grpc H:P --raft H:R --http H:Q on 127.0.91.11..13 with the same P, R, Q."""
    grpc, raft, http = (port_free_on(MASTER_HOSTS) for _ in range(3))
    masters = [
        LocalMaster(
            tmp_path / f"m{i}",
            f"{host}:{grpc}",
            f"{host}:{raft}",
            peers=[f"{other}:{raft}" for other in MASTER_HOSTS if other != host],
            http_address=f"{host}:{http}",
        )
        for i, host in enumerate(MASTER_HOSTS)
    ]
    try:
        for m in masters:
            m.start()
        wait_leader([m.grpc_address for m in masters], timeout_s=60)
        for m, host in zip(masters, MASTER_HOSTS):
            assert m.alive(), m.log_tail()
            assert listening_addresses(m.pid) == {(host, grpc), (host, raft), (host, http)}, m.log_tail()
    finally:
        for m in masters:
            m.kill()


def test_worker_and_router_bind_exactly_their_host(tmp_path):
    worker = WorkerProc(tmp_path)
    router = RouterProc(tmp_path, [worker.url])
    try:
        start_all([worker, router])
        assert listening_addresses(worker.proc.pid) == {("127.0.0.1", worker.port)}
        assert listening_addresses(router.proc.pid) == {("127.0.0.1", router.port)}
    finally:
        router.kill()
        worker.kill()
