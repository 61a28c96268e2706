"""Network namespaces for the local cluster, so a node can really be cut off the network.

Layout of one cluster (every name carries a tag hashed from the cluster dir):

  root namespace                            node namespaces
  bridge gcb-TAG  10.A.B.1/24  <- masters   gcn-TAG-n1: eth0 10.A.B.10/24 <- gcache-server
    port gcv-TAG-0  ---- veth ----          gcn-TAG-n2: eth0 10.A.B.11/24
    port gcv-TAG-1  ---- veth ----          ...
    port gck-TAG    (keeper: a veth whose other end stays up in the root
                     namespace, so the bridge never loses carrier)

Clients and masters stay in the root namespace and reach nodes through the
bridge; nodes reach each other and the masters (10.A.B.1) over it too.
partition() sets eth0 down inside the node's namespace: its connected route
goes, so the node reaches no one (ENETUNREACH), and frames to it are dropped
at the bridge (connects time out). The root side keeps its subnet route on the
bridge, so traffic to a cut node never leaks out through the default route.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

IP_TIMEOUT_S = 10.0
NODE_HOST_OFFSET = 10  # node index i lives at .(10 + i)
NODE_INDEX_MAX = 200  # keeps .(10 + i) below the broadcast address
SUBNET_TRIES_MAX = 4096
PROBE_TIMEOUT_S = 0.5
REACH_WAIT_S = 5.0
INNER_DEVICE = "eth0"


class NetnsError(RuntimeError):
    """An `ip` command failed or the network did not behave as set up."""


class NetnsUnavailableError(NetnsError):
    """This machine cannot run the cluster in network namespaces."""


@dataclass(frozen=True)
class Availability:
    """Whether network namespaces can be used here; falsy with the reason when not."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetnsError(f"ip {' '.join(args)}: {e}") from None
    if check and done.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)} failed: {done.stderr.strip() or done.returncode}")
    return done


@functools.lru_cache(maxsize=1)
def netns_available() -> Availability:
    """Probes once: root, the `ip` tool, and creating a namespace, a veth pair and a bridge."""
    if not sys.platform.startswith("linux"):
        return Availability(False, f"network namespaces need Linux, this is {sys.platform}")
    if os.geteuid() != 0:
        return Availability(False, "network namespaces need root (run as root, or use the loopback cluster)")
    if shutil.which("ip") is None:
        return Availability(False, "the `ip` tool (iproute2) is not installed")
    tag = f"p{os.getpid() % 10**7:07d}"
    ns, bridge, veth = f"gcprobe-{tag}", f"gcb-{tag}", f"gcv-{tag}"
    try:
        _ip("netns", "add", ns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", INNER_DEVICE, "netns", ns)
        _ip("link", "add", bridge, "type", "bridge")
        _ip("link", "set", veth, "master", bridge)
        return Availability(True)
    except NetnsError as e:
        return Availability(False, f"cannot set up a network namespace here: {e}")
    finally:
        _ip("link", "del", veth, check=False)
        _ip("link", "del", bridge, check=False)
        _ip("netns", "del", ns, check=False)


def require_netns() -> None:
    avail = netns_available()
    if not avail:
        raise NetnsUnavailableError(
            f"netns mode unavailable: {avail.reason}; run without --netns (partitions then fall back to SIGSTOP)"
        )


def tag_for(directory) -> str:
    """8 hex digits from the cluster dir: names stay <= 15 chars and differ between dirs."""
    return hashlib.sha256(str(Path(directory).resolve()).encode()).hexdigest()[:8]


def _routed_networks() -> list:
    nets = []
    for line in (
        _ip("-4", "route", "show", "table", "all").stdout.splitlines()
        + _ip("-4", "-o", "addr", "show").stdout.splitlines()
    ):
        for word in line.split():
            if word[0].isdigit() and ("/" in word or word.count(".") == 3):
                try:
                    nets.append(ipaddress.ip_network(word, strict=False))
                except ValueError:
                    pass
    return nets


def _free_subnet(tag: str) -> str:
    """A 10.A.B.0/24 that overlaps no route or address here, starting from the tag's hash."""
    used = _routed_networks()
    start = int(tag, 16)
    for i in range(SUBNET_TRIES_MAX):
        n = (start + i) % (1 << 16)
        cand = ipaddress.ip_network(f"10.{n >> 8}.{n & 0xFF}.0/24")
        if n >> 8 == 0 or n >> 8 == 255:
            continue  # 10.0.x and 10.255.x are the likeliest to be in use elsewhere
        if not any(cand.overlaps(u) for u in used):
            return str(cand)
    raise NetnsError(f"no free 10.x.y.0/24 subnet for the cluster bridge (routes: {used})")


def _tcp_reachable(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


UNREACHABLE_EXIT = 3


def _tcp_reachable_from(namespace: str, host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """A TCP connect made from inside `namespace` (a short python, so no extra tools needed)."""
    code = (
        "import socket,sys\ntry:\n socket.create_connection((sys.argv[1],int(sys.argv[2])),"
        f"timeout=float(sys.argv[3])).close()\nexcept OSError:\n sys.exit({UNREACHABLE_EXIT})"
    )
    try:
        done = subprocess.run(
            ["ip", "netns", "exec", namespace, sys.executable, "-S", "-I", "-c", code, host, str(port), str(timeout_s)],
            capture_output=True,
            text=True,
            timeout=timeout_s + IP_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return False
    if done.returncode not in (0, UNREACHABLE_EXIT):  # the probe itself failed: no verdict
        raise NetnsError(f"probe from {namespace} failed: {done.stderr.strip()[-500:]}")
    return done.returncode == 0


@dataclass
class NetnsNetwork:
    """The bridge, subnet and node namespaces of one local cluster (saved in cluster.json)."""

    tag: str
    subnet: str

    @property
    def bridge(self) -> str:
        return f"gcb-{self.tag}"

    @property
    def keeper(self) -> str:
        return f"gck-{self.tag}"

    @property
    def gateway(self) -> str:
        """The bridge's address: masters listen here, nodes reach them here."""
        return str(ipaddress.ip_network(self.subnet).network_address + 1)

    def node_host(self, index: int) -> str:
        if not 0 <= index < NODE_INDEX_MAX:
            raise ValueError(f"node index must be 0..{NODE_INDEX_MAX - 1}, got {index}")
        return str(ipaddress.ip_network(self.subnet).network_address + NODE_HOST_OFFSET + index)

    def namespace(self, node_id: str) -> str:
        return f"gcn-{self.tag}-{node_id}"

    def veth(self, index: int) -> str:
        return f"gcv-{self.tag}-{index}"

    def to_dict(self) -> dict:
        return {"mode": "netns", **asdict(self), "bridge": self.bridge, "gateway": self.gateway}

    @classmethod
    def from_dict(cls, d: dict) -> NetnsNetwork:
        return cls(tag=d["tag"], subnet=d["subnet"])

    # -- setting up ----------------------------------------------------------------

    @classmethod
    def create(cls, directory) -> NetnsNetwork:
        """Removes what a crashed earlier run from `directory` left, then makes the bridge."""
        require_netns()
        tag = tag_for(directory)
        teardown_tag(tag)
        net = cls(tag, _free_subnet(tag))
        try:
            _ip("link", "add", net.bridge, "type", "bridge", "forward_delay", "0")
            _ip("addr", "add", f"{net.gateway}/{ipaddress.ip_network(net.subnet).prefixlen}", "dev", net.bridge)
            _ip("link", "add", net.keeper, "type", "veth", "peer", "name", f"gckp-{tag}")
            _ip("link", "set", net.keeper, "master", net.bridge, "up")
            _ip("link", "set", f"gckp-{tag}", "up")
            _ip("link", "set", net.bridge, "up")
        except NetnsError:
            net.teardown()
            raise
        return net

    def add_node(self, node_id: str, index: int) -> tuple[str, str, str]:
        """A namespace for one node, wired to the bridge; returns (namespace, veth, host)."""
        ns, veth, host = self.namespace(node_id), self.veth(index), self.node_host(index)
        _ip("link", "del", veth, check=False)  # left by an earlier node at this index
        _ip("netns", "del", ns, check=False)
        try:
            _ip("netns", "add", ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", INNER_DEVICE, "netns", ns)
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{host}/{ipaddress.ip_network(self.subnet).prefixlen}", "dev", INNER_DEVICE)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", INNER_DEVICE, "up")
        except NetnsError:
            self.remove_node(ns, veth)
            raise
        return ns, veth, host

    def remove_node(self, namespace: str, veth: str) -> None:
        _kill_pids_in(namespace)
        _ip("link", "del", veth, check=False)
        _ip("netns", "del", namespace, check=False)

    def exec_prefix(self, namespace: str) -> list[str]:
        """Prepended to a command line to run it inside `namespace` (ip execs: same pid)."""
        return ["ip", "netns", "exec", namespace]

    # -- faults ------------------------------------------------------------------------

    def partition(self, namespace: str, host: str, port: int, master_port: int | None) -> None:
        """Cuts the node off, then checks it: the root namespace no longer reaches the node's
        host:port, and the node no longer reaches the master at gateway:master_port (if given)."""
        _ip("-n", namespace, "link", "set", INNER_DEVICE, "down")
        if _tcp_reachable(host, port):
            raise NetnsError(f"partition of {namespace}: {host}:{port} still answers from the root namespace")
        if master_port is not None and _tcp_reachable_from(namespace, self.gateway, master_port):
            raise NetnsError(f"partition of {namespace}: the node still reaches {self.gateway}:{master_port}")

    def heal(self, namespace: str, host: str, port: int, timeout_s: float = REACH_WAIT_S) -> None:
        """Brings the node's link back (the address and its route return with it) and waits
        until host:port answers from the root namespace again."""
        _ip("-n", namespace, "link", "set", INNER_DEVICE, "up")
        deadline = time.monotonic() + timeout_s
        while not _tcp_reachable(host, port):
            if time.monotonic() > deadline:
                raise NetnsError(f"heal of {namespace}: {host}:{port} does not answer within {timeout_s}s")
            time.sleep(0.05)

    def is_partitioned(self, namespace: str) -> bool:
        out = _ip("-n", namespace, "-o", "link", "show", INNER_DEVICE).stdout
        flags = out.partition("<")[2].partition(">")[0].split(",")
        return "UP" not in flags

    def teardown(self) -> None:
        teardown_tag(self.tag)


def _kill_pids_in(namespace: str) -> None:
    """SIGKILL what still runs in one of our namespaces (a crashed run's leftovers)."""
    for word in _ip("netns", "pids", namespace, check=False).stdout.split():
        try:
            os.kill(int(word), signal.SIGKILL)
        except (ValueError, ProcessLookupError, PermissionError):
            pass


def leftovers(tag: str) -> dict:
    """Namespaces and links of the cluster with this tag that exist now."""
    namespaces = [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines() if line.strip()]
    links = [
        line.split(":", 2)[1].strip().split("@")[0]
        for line in _ip("-o", "link", "show", check=False).stdout.splitlines()
        if line.count(":") >= 2
    ]
    ours = (f"gcb-{tag}", f"gck-{tag}", f"gckp-{tag}")
    return {
        "namespaces": sorted(n for n in namespaces if n.startswith(f"gcn-{tag}-")),
        "links": sorted(n for n in links if n in ours or n.startswith(f"gcv-{tag}-")),
    }


def teardown_tag(tag: str) -> None:
    """Deletes every namespace, veth and the bridge of this tag; does nothing if none is left."""
    found = leftovers(tag)
    for ns in found["namespaces"]:
        _kill_pids_in(ns)
        _ip("netns", "del", ns, check=False)
    for link in found["links"]:  # veths go with either end; the bridge last
        if link != f"gcb-{tag}":
            _ip("link", "del", link, check=False)
    _ip("link", "del", f"gcb-{tag}", check=False)
