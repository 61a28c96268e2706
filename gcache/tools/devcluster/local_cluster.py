"""A whole GCache cluster on one machine, each process on its own loopback address.

Masters listen on 127.0.0.11, .12, ... and nodes on 127.0.0.31, .32, ...
(ports picked free on each address). Used by `gcache-cluster up/down`,
gcache-demo, the checker and the tests. The layout is kept in DIR/cluster.json
so another process (`gcache-cluster down`) can find and stop what `up` started:

  {"client_url": "gcache://...", "settings": {...},
   "network": {"mode": "loopback"} | {"mode": "netns", "tag", "subnet", "bridge", "gateway"},
   "members": [{"role": "master"|"node", "id", "host", "ports": {...},
                "data_dir", "log", "pid", "netns", "veth"}, ...]}

With netns=True (root, iproute2; gcache/tools/devcluster/netns.py) every node runs in
its own network namespace behind a bridge, and partition(node) really cuts it
off the network; masters listen on the bridge address with distinct ports.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gcache.cluster.cluster_map import ACTIVE, ClusterMap
from gcache.cluster.master_api import MasterClient, MasterCredentials, MasterUnavailableError
from gcache.common.file_modes import make_private_dir
from gcache.common.processes import PidProcess, Process, free_port, stop_process, stop_processes
from gcache.tools.devcluster import local_security
from gcache.tools.devcluster.local_masters import master_command
from gcache.tools.devcluster.local_masters import wait_leader as wait_master_leader
from gcache.tools.devcluster.local_server import node_args, server_command
from gcache.tools.devcluster.netns import NetnsNetwork, require_netns

MASTER_HOST_BASE = 11
NODE_HOST_BASE = 31
MASTERS_MAX = 5
NODES_MAX = 64
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
LAYOUT_FILE = "cluster.json"
# A node's namespace is its own: every node can use the same fixed ports there.
NETNS_NODE_PORTS = {"data": 7600, "admin": 7601}
EXEC_WAIT_S = 5.0


@dataclass
class Member:
    """One process of the local cluster."""

    role: str  # "master" or "node"
    id: str
    host: str
    ports: dict
    data_dir: str
    log: str
    args: list = field(default_factory=list)
    pid: int = 0
    netns: str = ""  # the node's network namespace in netns mode
    veth: str = ""  # its root-side veth, a port of the cluster bridge

    @property
    def address(self) -> str:
        """The address clients use: the gRPC API of a master, the data port of a node."""
        return f"{self.host}:{self.ports['grpc' if self.role == 'master' else 'data']}"

    def process(self) -> PidProcess:
        """Its process by pid: its command line names its data dir, so a reused pid is not it."""
        return PidProcess(self.pid, self.data_dir)

    def alive(self) -> bool:
        return self.process().running()

    def send(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)


class LocalCluster:
    """Starts, changes and stops a local cluster. Not thread-safe: one controller at a time."""

    def __init__(
        self,
        directory,
        *,
        masters: int = 3,
        nodes: int = 3,
        memory: str = "256MiB",
        disk: str = "512MiB",
        heartbeat_interval_s: float = 0.5,
        heartbeat_timeout_s: float = 3.0,
        migration_timeout_s: float = 60.0,
        tick_s: float = 0.2,
        node_args=(),
        master_args=(),
        node_disks=(),
        netns: bool = False,
        auth: bool = False,
        tls: bool = False,
    ):
        if not 1 <= masters <= MASTERS_MAX:
            raise ValueError(f"masters must be 1..{MASTERS_MAX}, got {masters}")
        if not 0 <= nodes <= NODES_MAX:
            raise ValueError(f"nodes must be 0..{NODES_MAX}, got {nodes}")
        self.dir = Path(directory).resolve()
        self.settings: dict[str, Any] = dict(  # saved in the layout file (JSON)
            masters=masters,
            nodes=nodes,
            memory=memory,
            disk=disk,
            heartbeat_interval_s=heartbeat_interval_s,
            heartbeat_timeout_s=heartbeat_timeout_s,
            migration_timeout_s=migration_timeout_s,
            tick_s=tick_s,
            node_args=list(node_args),
            master_args=list(master_args),
            # Per node (n1, n2, ...; cycled): its --disk instead of `disk`, so nodes can have
            # different capacities and so map weights (disk files grow as written).
            node_disks=list(node_disks),
            netns=bool(netns),
            auth=bool(auth),
            tls=bool(tls),
        )
        if netns:
            require_netns()  # says why not, before anything starts
        self.network: NetnsNetwork | None = None  # set by up() in netns mode
        self.members: list[Member] = []
        self._procs: dict[int, subprocess.Popen] = {}
        self._master_client: MasterClient | None = None

    # -- layout ----------------------------------------------------------------

    @property
    def masters(self) -> list[Member]:
        return [m for m in self.members if m.role == "master"]

    @property
    def nodes(self) -> list[Member]:
        return [m for m in self.members if m.role == "node"]

    @property
    def netns_mode(self) -> bool:
        return self.network is not None

    @property
    def client_url(self) -> str:
        return "gcache://" + ",".join(m.address for m in self.masters)

    def member(self, member_id: str) -> Member:
        for m in self.members:
            if m.id == member_id:
                return m
        raise KeyError(f"no member {member_id!r} in {self.dir / LAYOUT_FILE}")

    def save(self) -> None:
        layout = {
            "client_url": self.client_url,
            "settings": self.settings,
            "network": self.network.to_dict() if self.network else {"mode": "loopback"},
            "members": [asdict(m) for m in self.members],
        }
        tmp = self.dir / (LAYOUT_FILE + ".tmp")
        tmp.write_text(json.dumps(layout, indent=2) + "\n")
        os.replace(tmp, self.dir / LAYOUT_FILE)

    @classmethod
    def load(cls, directory) -> LocalCluster:
        path = Path(directory).resolve() / LAYOUT_FILE
        try:
            layout = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise FileNotFoundError(f"{path}: no cluster layout here ({e}); run gcache-cluster up") from None
        settings = dict(layout["settings"])
        netns = settings.pop("netns", False)
        cluster = cls(directory, **settings)  # no availability probe: down must work regardless
        cluster.settings["netns"] = netns
        if layout.get("network", {}).get("mode") == "netns":
            cluster.network = NetnsNetwork.from_dict(layout["network"])
        cluster.members = [Member(**m) for m in layout["members"]]
        return cluster

    # -- credentials (auth / tls settings; gcache/tools/devcluster/local_security.py) ------------

    @property
    def secrets_dir(self) -> Path:
        return self.dir / "secrets"

    def _pki(self) -> dict:
        return local_security.make_pki(self.secrets_dir, sorted({m.host for m in self.masters}))

    def master_credentials(self, tenant: str = "ops") -> MasterCredentials:
        """Credentials towards the masters: `tenant`'s token (auth) and the local CA (tls)."""
        token = local_security.token(self.secrets_dir, tenant) if self.settings.get("auth") else None
        tls_ca = self._pki()["ca"] if self.settings.get("tls") else None
        return MasterCredentials(token=token, tls_ca=tls_ca)

    @property
    def client_kwargs(self) -> dict:
        """What gcache.Client(client_url, **client_kwargs) needs: the app tenant's token, the CA."""
        creds = self.master_credentials("app")
        return {k: v for k, v in (("token", creds.token), ("tls_ca", creds.tls_ca)) if v}

    def master_client(self) -> MasterClient:
        if self._master_client is None:
            self._master_client = MasterClient(
                [m.address for m in self.masters], timeout_s=1.0, credentials=self.master_credentials()
            )
        return self._master_client

    # -- processes ---------------------------------------------------------------

    def _free_ports(self, host: str, names) -> dict:
        """Free ports on `host`, distinct from each other and from every member's on that host."""
        taken = {p for m in self.members if m.host == host for p in m.ports.values()}
        ports = {}
        for name in names:
            for _ in range(100):
                port = free_port(host)
                if port not in taken:
                    break
            taken.add(port)
            ports[name] = port
        return ports

    def _new_master(self, index: int) -> Member:
        host = self.network.gateway if self.network else f"127.0.0.{MASTER_HOST_BASE + index}"
        ports = self._free_ports(host, ("grpc", "raft", "http"))
        mid = f"m{index + 1}"
        return Member("master", mid, host, ports, str(self.dir / mid), str(self.dir / f"{mid}.log"))

    def _master_args(self, m: Member) -> list[str]:
        s = self.settings
        peers = [f"{o.host}:{o.ports['raft']}" for o in self.masters if o is not m]
        return master_command(
            grpc_address=m.address,
            raft_address=f"{m.host}:{m.ports['raft']}",
            peers=peers,
            data_dir=m.data_dir,
            http_address=f"{m.host}:{m.ports['http']}",
            extra=[
                "--heartbeat-timeout-s",
                str(s["heartbeat_timeout_s"]),
                "--migration-timeout-s",
                str(s["migration_timeout_s"]),
                "--tick-s",
                str(s["tick_s"]),
                *self._security_args("master"),
                *s["master_args"],
            ],
        )

    def _security_args(self, role: str) -> list[str]:
        args = []
        if self.settings.get("auth"):
            args += ["--auth-file", str(self.secrets_dir / local_security.AUTH_FILE)]
        if self.settings.get("tls"):
            pki = self._pki()
            args += (
                ["--tls-cert", pki["cert"], "--tls-key", pki["key"]]
                if role == "master"
                else ["--master-tls-ca", pki["ca"]]
            )
        return args

    def _new_node(self) -> Member:
        used = {m.id for m in self.nodes}
        index = next((i for i in range(NODES_MAX) if f"n{i + 1}" not in used), None)
        if index is None:
            raise RuntimeError(f"at most {NODES_MAX} nodes per local cluster")
        nid = f"n{index + 1}"
        namespace = veth = ""
        if self.network:
            namespace, veth, host = self.network.add_node(nid, index)
            ports = dict(NETNS_NODE_PORTS)
        else:
            host = f"127.0.0.{NODE_HOST_BASE + index}"
            ports = self._free_ports(host, ("data", "admin"))
        return Member(
            "node", nid, host, ports, str(self.dir / nid), str(self.dir / f"{nid}.log"), netns=namespace, veth=veth
        )

    def _node_args(self, n: Member) -> list[str]:
        s = self.settings
        # `ip netns exec` execs the server, so the pid Popen returns is the server's.
        prefix = self.network.exec_prefix(n.netns) if self.network and n.netns else []
        node = node_args(
            masters=",".join(m.address for m in self.masters),
            node_id=n.id,
            advertise=n.address,
            heartbeat_interval_s=s["heartbeat_interval_s"],
        )
        return [
            *prefix,
            *server_command(
                host=n.host,
                port=n.ports["data"],
                admin_host=n.host,
                admin_port=n.ports["admin"],
                memory=s["memory"],
                disk=self._disk_of(n),
                data_dir=n.data_dir,
                extra=[*node, *self._security_args("node"), *s["node_args"]],
            ),
        ]

    def _disk_of(self, n: Member) -> str:
        disks = self.settings.get("node_disks") or []
        return disks[(int(n.id[1:]) - 1) % len(disks)] if disks else self.settings["disk"]

    def start(self, m: Member) -> None:
        """Starts (or restarts) one member's process, detached from the caller's terminal."""
        if m.alive():
            raise RuntimeError(f"{m.role} {m.id} is already running (pid {m.pid})")
        make_private_dir(Path(m.data_dir))  # 0700: the daemon refuses a dir others may read
        m.args = self._master_args(m) if m.role == "master" else self._node_args(m)
        with open(m.log, "ab") as log:
            proc = subprocess.Popen(
                m.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        self._procs[proc.pid] = proc
        m.pid = proc.pid
        self.save()
        if m.netns:
            self._wait_exec(m, proc)

    def _wait_exec(self, m: Member, proc: subprocess.Popen) -> None:
        """Waits until `ip netns exec` has exec'd the server (same pid, new command line)."""
        deadline = time.monotonic() + EXEC_WAIT_S
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
                    argv0 = f.read().split(b"\0", 1)[0]
            except OSError:
                argv0 = b""
            if argv0 and os.path.basename(argv0) != b"ip":
                return
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{m.role} {m.id} exited at start (status {proc.returncode}): {self.log_tail(m, 1500)}"
                )
            time.sleep(0.01)
        raise RuntimeError(f"{m.role} {m.id}: `ip netns exec` did not start the server within {EXEC_WAIT_S}s")

    def _reap(self) -> None:
        for pid, proc in list(self._procs.items()):
            if proc.poll() is not None:
                del self._procs[pid]

    def _process(self, m: Member) -> Process:
        """Our Popen when this object started `m` (exact, and reaped), else its pid from the layout."""
        proc = self._procs.get(m.pid)
        return proc if proc is not None else m.process()

    def stop(self, m: Member, sig: int = signal.SIGTERM, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Sends `sig` and waits for the exit; SIGKILL after `timeout_s`. A paused process is resumed."""
        try:
            stop_process(self._process(m), sig, timeout_s)
        finally:
            self._reap()

    def kill(self, m: Member) -> None:
        self.stop(m, signal.SIGKILL)

    # -- network faults (netns mode) ----------------------------------------------------

    def _netns_node(self, m: Member) -> NetnsNetwork:
        if self.network is None or not m.netns:
            raise RuntimeError(
                f"{m.id} has no network namespace: partition needs LocalCluster(netns=True) / gcache-cluster up --netns"
            )
        return self.network

    def partition(self, m: Member) -> None:
        """Cuts node `m` off the network (its namespace's link down) and checks the cut."""
        net = self._netns_node(m)
        live = [x for x in self.masters if x.alive()]
        net.partition(m.netns, m.host, m.ports["data"], live[0].ports["grpc"] if live else None)

    def heal(self, m: Member) -> None:
        """Brings node `m`'s link back and waits until its data port answers again."""
        self._netns_node(m).heal(m.netns, m.host, m.ports["data"])

    def exit_code(self, m: Member) -> int | None:
        proc = self._procs.get(m.pid)
        return proc.poll() if proc is not None else None

    def log_tail(self, m: Member, chars: int = 3000) -> str:
        try:
            return Path(m.log).read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    # -- waiting -------------------------------------------------------------------

    def wait_leader(self, timeout_s: float = START_TIMEOUT_S) -> Member:
        """The master member that leads, once a majority of the replicas agree on it."""
        address = wait_master_leader(
            [m.address for m in self.masters], timeout_s, credentials=self.master_credentials()
        )
        return next(m for m in self.masters if m.address == address)

    def current_map(self) -> ClusterMap:
        cmap = self.master_client().get_map()
        return cmap if cmap is not None else ClusterMap.empty()

    def wait_map(self, predicate, timeout_s: float, what: str) -> ClusterMap:
        """Polls the masters until predicate(map) holds; TimeoutError says what was awaited."""
        deadline = time.monotonic() + timeout_s
        cmap = None
        while time.monotonic() < deadline:
            try:
                cmap = self.current_map()
                if predicate(cmap):
                    return cmap
            except MasterUnavailableError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{what}: not reached within {timeout_s}s; last map {cmap}")

    def wait_active(self, node_ids, timeout_s: float = START_TIMEOUT_S) -> ClusterMap:
        ids = set(node_ids)

        def all_active(cmap: ClusterMap) -> bool:
            return all((n := cmap.node(i)) is not None and n.state == ACTIVE for i in ids)

        return self.wait_map(all_active, timeout_s, f"nodes {sorted(ids)} active")

    # -- whole-cluster operations ------------------------------------------------------

    def up(self, timeout_s: float = START_TIMEOUT_S) -> LocalCluster:
        """Starts every master, waits for a leader, starts every node, waits until all are active."""
        self.dir.mkdir(parents=True, exist_ok=True)
        if (self.dir / LAYOUT_FILE).exists():
            previous = LocalCluster.load(self.dir)
            if any(m.alive() for m in previous.members):
                raise RuntimeError(f"a cluster already runs from {self.dir}; gcache-cluster down --dir {self.dir}")
            if previous.network is not None:
                previous.network.teardown()  # a crashed netns run's namespaces and bridge
        try:
            if self.settings["netns"]:
                self.network = NetnsNetwork.create(self.dir)
            self.members = []
            for i in range(self.settings["masters"]):
                self.members.append(self._new_master(i))
            if self.settings.get("auth"):
                local_security.write_auth_file(self.secrets_dir)
            if self.settings.get("tls"):
                self._pki()
            for m in self.masters:
                self.start(m)
            self.wait_leader(timeout_s)
            for _ in range(self.settings["nodes"]):
                self.members.append(self._new_node())
            for n in self.nodes:
                self.start(n)
            self.wait_active([n.id for n in self.nodes], timeout_s)
        except BaseException:
            self.down()
            raise
        return self

    def add_node(self, timeout_s: float = START_TIMEOUT_S, wait_active: bool = True) -> Member:
        """Starts one more node (a join); waits until the master has it active."""
        n = self._new_node()
        self.members.append(n)
        self.start(n)
        if wait_active:
            self.wait_active([n.id], timeout_s)
        return n

    def down(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM every node, then every master; SIGKILL what does not exit within timeout_s."""
        try:
            for group in (self.nodes, self.masters):
                stop_processes([self._process(m) for m in group], signal.SIGTERM, timeout_s)
        finally:
            self._reap()
            if self._master_client is not None:
                self._master_client.close()
                self._master_client = None
            if self.members:
                self.save()
            if self.network is not None:  # processes first: nothing holds a namespace any more
                self.network.teardown()
