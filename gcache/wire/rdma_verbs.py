"""pyverbs for both ends of transport "rdma" (docs/protocol.md, "RDMA").

One device per process side (`open_device`), and per TCP connection one
reliable-connected queue pair, set up from the peer's endpoint description
that RDMA_CONNECT carries. Everything that needs pyverbs or a device raises
RdmaUnavailable saying precisely what is missing; the endpoint checks
(`parse_endpoint`, `choose_gid_index`) are plain Python.

Environment (both sides): $GCACHE_RDMA_PORT (the device port, default 1),
$GCACHE_RDMA_GID_INDEX (default: chosen by `choose_gid_index`); clients also
read $GCACHE_RDMA_DEVICE (default: the first device).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Any

RDMA_DEVICE_ENV = "GCACHE_RDMA_DEVICE"
RDMA_PORT_ENV = "GCACHE_RDMA_PORT"
RDMA_GID_INDEX_ENV = "GCACHE_RDMA_GID_INDEX"
PYVERBS_INSTALL_HINT = (
    "install the distribution's rdma-core bindings (Debian/Ubuntu: apt-get install "
    "python3-pyverbs, importable from a venv of the same Python version once "
    "/usr/lib/python3/dist-packages/pyverbs is linked into its site-packages), or "
    "pip install pyverbs (builds rdma-core: needs cmake, cython, libnl-3-dev, "
    "libnl-route-3-dev)"
)
ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
_IPV4_MAPPED_GID_PREFIX = "0000:0000:0000:0000:0000:ffff:"
RD_ATOMIC_MAX = 16  # RDMA READs in flight per queue pair (capped by the device)
PSN_MASK = 0xFFFFFF  # packet sequence numbers are 24 bits
QPN_MAX = 0xFFFFFF
MTU_ENUMS = (1, 2, 3, 4, 5)  # IBV_MTU_256 .. IBV_MTU_4096


class RdmaUnavailable(Exception):
    """pyverbs or a usable device is missing; str() is the reason."""


def load() -> _Verbs:
    """The pyverbs modules this file uses, as one namespace."""
    try:
        import pyverbs.enums as enums
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.cq import CQ
        from pyverbs.device import Context, get_device_list
        from pyverbs.mr import MR
        from pyverbs.pd import PD
        from pyverbs.pyverbs_error import PyverbsError
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
        from pyverbs.wr import SGE, SendWR
    except ImportError as exc:
        raise RdmaUnavailable(f"pyverbs is not importable ({exc}): {PYVERBS_INSTALL_HINT}") from exc
    return _Verbs(
        enums,
        GID,
        AHAttr,
        GlobalRoute,
        CQ,
        Context,
        get_device_list,
        MR,
        PD,
        PyverbsError,
        QP,
        QPAttr,
        QPCap,
        QPInitAttr,
        SGE,
        SendWR,
    )


@dataclass(frozen=True)
class _Verbs:
    e: Any  # pyverbs.enums
    GID: type
    AHAttr: type
    GlobalRoute: type
    CQ: type
    Context: type
    get_device_list: Any
    MR: type
    PD: type
    PyverbsError: type[Exception]
    QP: type
    QPAttr: type
    QPCap: type
    QPInitAttr: type
    SGE: type
    SendWR: type


def device_names(verbs: _Verbs) -> list[str]:
    """The RDMA devices of this host; RdmaUnavailable when there are none."""
    try:
        devices = verbs.get_device_list()
    except verbs.PyverbsError as exc:
        raise RdmaUnavailable(
            f"no RDMA device: listing them failed ({exc}); this host's kernel offers none "
            "(/sys/class/infiniband is missing or empty)"
        ) from exc
    names = [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices]
    if not names:
        raise RdmaUnavailable("no RDMA device on this host (/sys/class/infiniband is empty)")
    return names


def choose_gid_index(gids: list[tuple[int, str, bool]], ethernet: bool) -> int:
    """The GID index to route with, from (index, gid, is RoCE v2) entries of a port:
    InfiniBand: 0. RoCE: an IPv4-mapped RoCE v2 GID (routable), else any
    RoCE v2 GID, else any non-zero one."""
    if not ethernet:
        return 0
    usable = [(i, gid.lower(), v2) for i, gid, v2 in gids if gid.lower() != ZERO_GID]
    for wanted in (lambda g, v2: v2 and g.startswith(_IPV4_MAPPED_GID_PREFIX), lambda g, v2: v2, lambda g, v2: True):
        for i, gid, v2 in usable:
            if wanted(gid, v2):
                return i
    raise RdmaUnavailable("the RDMA port has no usable GID (RoCE needs an IP address on its netdev)")


def _int_field(meta: dict[str, Any], name: str, lo: int, hi: int) -> int:
    value = meta.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ValueError(f"RDMA endpoint field {name!r} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def parse_endpoint(meta: dict[str, Any]) -> dict[str, Any]:
    """A peer's queue-pair endpoint from RDMA_CONNECT metadata; ValueError naming the bad field."""
    if not isinstance(meta, dict):
        raise ValueError(f"RDMA_CONNECT metadata must be a map, got {type(meta).__name__}")
    gid = meta.get("gid")
    if isinstance(gid, bytes):
        gid = gid.decode("ascii", "replace")
    parts = gid.split(":") if isinstance(gid, str) else []
    if (
        not isinstance(gid, str)
        or len(parts) != 8
        or not all(len(p) == 4 and all(c in "0123456789abcdefABCDEF" for c in p) for p in parts)
    ):
        raise ValueError(
            f"RDMA endpoint field 'gid' must look like xxxx:xxxx:xxxx:xxxx:xxxx:xxxx:xxxx:xxxx, got {meta.get('gid')!r}"
        )
    return {
        "qpn": _int_field(meta, "qpn", 1, QPN_MAX),
        "psn": _int_field(meta, "psn", 0, PSN_MASK),
        "lid": _int_field(meta, "lid", 0, 0xFFFF),
        "gid": gid.lower(),
        "mtu": _int_field(meta, "mtu", MTU_ENUMS[0], MTU_ENUMS[-1]),
    }


def _env_int(name: str, default: int | None) -> int | None:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    if not text.isdigit():
        raise RdmaUnavailable(f"${name} must be a non-negative integer, got {text!r}")
    return int(text)


class Device:
    """One opened RDMA device port, with its protection domain."""

    def __init__(self, verbs: _Verbs, name: str | None):
        self.v = verbs
        names = device_names(verbs)
        if name is None:
            name = names[0]
        elif name not in names:
            raise RdmaUnavailable(f"no RDMA device named {name!r} on this host (it has: {', '.join(names)})")
        self.name = name
        self.port = _env_int(RDMA_PORT_ENV, 1)
        e = verbs.e
        self.ctx = verbs.Context(name=name)
        try:
            port = self.ctx.query_port(self.port)
            if port.state != e.IBV_PORT_ACTIVE:
                raise RdmaUnavailable(f"RDMA device {name} port {self.port} is not active (state {port.state})")
            self.lid = port.lid
            self.mtu = port.active_mtu
            self.ethernet = port.link_layer == e.IBV_LINK_LAYER_ETHERNET
            self.gid_index = _env_int(RDMA_GID_INDEX_ENV, None)
            if self.gid_index is None:
                self.gid_index = choose_gid_index(self._gids(port.gid_tbl_len), self.ethernet)
            self.gid = str(self.ctx.query_gid(self.port, self.gid_index)).lower()
            attr = self.ctx.query_device()
            self.rd_atomic = max(1, min(RD_ATOMIC_MAX, attr.max_qp_rd_atom, attr.max_qp_init_rd_atom))
            self.pd = verbs.PD(self.ctx)
        except BaseException:
            self.ctx.close()
            raise

    def _gids(self, count: int) -> list[tuple[int, str, bool]]:
        v2 = getattr(self.v.e, "IBV_GID_TYPE_SYSFS_ROCE_V2", None)
        out = []
        for i in range(count):
            try:
                gid = str(self.ctx.query_gid(self.port, i))
                kind = self.ctx.query_gid_type(self.port, i) if self.ethernet else None
            except self.v.PyverbsError:
                continue  # an empty slot of the table
            out.append((i, gid, v2 is not None and kind == v2))
        return out

    def register(self, address: int, length: int, remote: bool) -> Any:
        """A memory region over [address, address + length); remote: peers may read and write it."""
        e = self.v.e
        access = e.IBV_ACCESS_LOCAL_WRITE
        if remote:
            access |= e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
        try:
            return self.v.MR(self.pd, length, access, address=address)
        except self.v.PyverbsError as exc:
            raise RdmaUnavailable(
                f"cannot register {length} bytes with RDMA device {self.name}: {exc} (a low "
                "`ulimit -l` (locked memory) is the usual cause)"
            ) from exc

    def queue_pair(self, depth: int) -> QueuePair:
        return QueuePair(self, depth)

    def close(self) -> None:
        self.ctx.close()  # pyverbs closes what was made from it (PD, MRs, CQs, QPs) first


class QueuePair:
    """An RC queue pair with its own completion queue; `endpoint()` describes it to the peer."""

    def __init__(self, device: Device, depth: int):
        v, e = device.v, device.v.e
        self.device = device
        self.depth = depth
        self.psn = random.randint(0, PSN_MASK)
        self.cq = v.CQ(device.ctx, depth)
        try:
            cap = v.QPCap(max_send_wr=depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
            init = v.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap)
            self.qp = v.QP(device.pd, init)
            attr = v.QPAttr(port_num=device.port)
            attr.pkey_index = 0
            attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
            self.qp.to_init(attr)
        except BaseException:
            self.cq.close()
            raise

    def endpoint(self) -> dict[str, Any]:
        d = self.device
        return {"qpn": self.qp.qp_num, "psn": self.psn, "lid": d.lid, "gid": d.gid, "mtu": d.mtu}

    def connect(self, peer: dict[str, Any]) -> None:
        """INIT -> RTR -> RTS towards the peer's endpoint (parse_endpoint's dict)."""
        attr = connect_attributes(self.device.v, self.device, peer, self.psn)
        self.qp.to_rtr(attr)
        self.qp.to_rts(attr)

    def post(
        self, write: bool, local_addr: int, lkey: int, remote_addr: int, rkey: int, length: int, wr_id: int
    ) -> None:
        """One signaled RDMA READ (remote -> local) or WRITE (local -> remote)."""
        self.qp.post_send(work_request(self.device.v, write, local_addr, lkey, remote_addr, rkey, length, wr_id))

    def poll(self, most: int) -> list[tuple[int, int]]:
        """Completions ready now: (wr_id, status), status 0 = success."""
        _, wcs = self.cq.poll(most)
        return [(wc.wr_id, wc.status) for wc in wcs]

    def close(self) -> None:
        self.qp.close()
        self.cq.close()


def connect_attributes(verbs: _Verbs, local: Device, peer: dict[str, Any], psn: int) -> Any:
    """The QPAttr for INIT -> RTR -> RTS of an RC queue pair on `local` (a Device:
    port, mtu, ethernet, gid_index, rd_atomic) towards `peer` (parse_endpoint's dict)."""
    attr = verbs.QPAttr(port_num=local.port)
    attr.path_mtu = min(local.mtu, peer["mtu"])
    attr.dest_qp_num = peer["qpn"]
    attr.rq_psn = peer["psn"]
    attr.max_dest_rd_atomic = local.rd_atomic
    attr.min_rnr_timer = 12
    if local.ethernet or peer["lid"] == 0:  # RoCE routes by GID; InfiniBand by LID
        route = verbs.GlobalRoute(dgid=verbs.GID(peer["gid"]), sgid_index=local.gid_index, hop_limit=64)
        attr.ah_attr = verbs.AHAttr(port_num=local.port, is_global=1, gr=route, dlid=peer["lid"])
    else:
        attr.ah_attr = verbs.AHAttr(port_num=local.port, dlid=peer["lid"])
    attr.timeout = 14  # 4.096 us * 2^14 = 67 ms per try
    attr.retry_cnt = 7
    attr.rnr_retry = 7
    attr.sq_psn = psn
    attr.max_rd_atomic = local.rd_atomic
    return attr


def work_request(
    verbs: _Verbs, write: bool, local_addr: int, lkey: int, remote_addr: int, rkey: int, length: int, wr_id: int
) -> Any:
    """A signaled RDMA WRITE (local -> remote) or READ (remote -> local) of one buffer."""
    e = verbs.e
    wr = verbs.SendWR(
        wr_id=wr_id,
        opcode=e.IBV_WR_RDMA_WRITE if write else e.IBV_WR_RDMA_READ,
        num_sge=1,
        sg=[verbs.SGE(local_addr, length, lkey)],
        send_flags=e.IBV_SEND_SIGNALED,
    )
    wr.set_wr_rdma(rkey, remote_addr)
    return wr
