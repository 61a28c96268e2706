"""Start gcache-master replicas as local subprocesses (tests, `gcache-cluster up`).

  masters = start_masters(3, base_dir, heartbeat_timeout_s=1.0)
  leader = wait_leader([m.grpc_address for m in masters], timeout_s=20)
  ...
  for m in masters: m.stop()

Each replica gets its own loopback address (127.0.0.21, .22, ...) with free
ports, its own data dir under `base_dir`, and its output in base_dir/master-N.log.
Processes run in their own process group, so a stop never reaches the caller.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc

from gcache.cluster import master_api as api
from gcache.common.address import parse_host_port
from gcache.common.file_modes import make_private_dir
from gcache.common.processes import free_port, stop_process, wait_listening

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0
POLL_S = 0.05


def master_command(
    *, grpc_address: str, raft_address: str, peers, data_dir, http_address: str = "", extra=()
) -> list[str]:
    """The gcache-master command line of every launcher here (LocalMaster, LocalCluster's masters)."""
    args = [
        sys.executable,
        "-m",
        "gcache.master.main",
        "--grpc",
        grpc_address,
        "--raft",
        raft_address,
        "--peers",
        ",".join(peers),
        "--data-dir",
        str(data_dir),
    ]
    if http_address:
        args += ["--http", http_address]
    return args + list(extra)


def _flag_args(flags: dict) -> list[str]:
    """{"heartbeat_timeout_s": 1.0} -> ["--heartbeat-timeout-s", "1.0"]."""
    out = []
    for name, value in flags.items():
        out += [f"--{name.replace('_', '-')}", str(value)]
    return out


class LocalMaster:
    """One gcache-master subprocess; start() may be called again after stop() (same ports, same data)."""

    def __init__(
        self, data_dir, grpc_address: str, raft_address: str, peers=(), http_address: str = "", log_path=None, **flags
    ):
        self.data_dir = Path(data_dir)
        self.grpc_address = grpc_address
        self.raft_address = raft_address
        self.http_address = http_address
        self.peers = list(peers)
        self.flags = flags
        self.log_path = Path(log_path) if log_path else self.data_dir.parent / f"{self.data_dir.name}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def args(self) -> list[str]:
        return master_command(
            grpc_address=self.grpc_address,
            raft_address=self.raft_address,
            peers=self.peers,
            data_dir=self.data_dir,
            http_address=self.http_address,
            extra=_flag_args(self.flags),
        )

    def start(self, timeout_s: float = START_TIMEOUT_S) -> LocalMaster:
        """Starts the process and returns once its gRPC port accepts connections."""
        if self.alive():
            return self
        make_private_dir(self.data_dir)  # 0700: the daemon refuses a dir others may read
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.args(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        host, port = parse_host_port(self.grpc_address)
        try:
            wait_listening(self.proc, port, timeout_s, f"gcache-master {self.grpc_address}", self.log_tail, host=host)
        except RuntimeError:
            self.kill()
            raise
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """Sends `sig` and waits; SIGKILL after `timeout_s`. Returns the exit code (None if never started)."""
        if self.proc is None:
            return None
        return stop_process(self.proc, sig, timeout_s, group=True)

    def kill(self) -> None:
        """SIGKILL to the whole process group (the replica and anything it started)."""
        if self.proc is not None:
            stop_process(self.proc, signal.SIGKILL, STOP_TIMEOUT_S, group=True)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def start_masters(
    n: int, base_dir, host_prefix: str = "127.0.0.", first_host: int = 21, http: bool = False, **flags
) -> list[LocalMaster]:
    """Starts `n` replicas peered together, replica i on host `host_prefix + (first_host + i)`.

    `flags` become command-line flags (heartbeat_timeout_s=1.0 -> --heartbeat-timeout-s 1.0);
    `http` gives each replica a probe endpoint too. On a failed start every replica started is killed.
    """
    if not 1 <= n <= api.MASTERS_MAX:
        raise ValueError(f"n must be 1..{api.MASTERS_MAX}, got {n}")
    base_dir = Path(base_dir)
    hosts = [f"{host_prefix}{first_host + i}" for i in range(n)]
    raft = [f"{h}:{free_port(h)}" for h in hosts]
    masters = []
    for i, host in enumerate(hosts):
        masters.append(
            LocalMaster(
                base_dir / f"master-{i}",
                grpc_address=f"{host}:{free_port(host)}",
                raft_address=raft[i],
                peers=[r for r in raft if r != raft[i]],
                http_address=f"{host}:{free_port(host)}" if http else "",
                log_path=base_dir / f"master-{i}.log",
                **flags,
            )
        )
    try:
        for m in masters:
            m.start()
    except BaseException:
        for m in masters:
            m.kill()
        raise
    return masters


def master_status(address: str, timeout_s: float = 1.0, credentials=None) -> dict | None:
    """Status of one replica, or None if it does not answer."""
    client = api.MasterClient([address], timeout_s=timeout_s, credentials=credentials)
    try:
        return client.call("Status")
    except (api.MasterUnavailableError, grpc.RpcError):
        return None
    finally:
        client.close()


def wait_leader(addresses, timeout_s: float, credentials=None) -> str:
    """The gRPC address of the replica that leads, once a majority of `addresses` agree on it
    (so the answer is not a deposed leader's). Raises TimeoutError after `timeout_s`."""
    addresses = list(addresses)
    deadline = time.monotonic() + timeout_s
    last = {}
    while time.monotonic() < deadline:
        last = {
            a: master_status(a, timeout_s=min(1.0, max(0.1, deadline - time.monotonic())), credentials=credentials)
            for a in addresses
        }
        leaders = [a for a, s in last.items() if s and s["raft"]["is_leader"]]
        if len(leaders) == 1:
            leader = last[leaders[0]]
            if leader is None:  # cannot happen: it answered
                raise RuntimeError("invariant broken: it answered")
            leader_raft = leader["raft"]["self"]
            agree = sum(1 for s in last.values() if s and s["raft"]["leader"] == leader_raft)
            if agree > len(addresses) // 2:
                return leaders[0]
        time.sleep(POLL_S * 2)
    summary = {a: (s["raft"]["leader"] if s else "no answer") for a, s in last.items()}
    raise TimeoutError(f"no gcache-master leader within {timeout_s}s; leaders seen: {summary}")
