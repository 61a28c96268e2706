"""The TCP addresses a process listens on, from /proc/net/tcp{,6} and its fds (what `ss -ltnp`
shows), for tests that every listener binds exactly the address it was given."""

from __future__ import annotations

import ipaddress
import os
import socket

LISTEN = "0A"


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def _address(hex_address: str, family: int) -> tuple[str, int]:
    host_hex, port_hex = hex_address.split(":")
    raw = bytes.fromhex(host_hex)
    # The kernel prints each 32-bit word in host (little-endian) order.
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.IPv4Address(raw) if family == socket.AF_INET else ipaddress.IPv6Address(raw)
    if family == socket.AF_INET6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # an AF_INET6 socket bound to ::ffff:a.b.c.d listens on a.b.c.d only
    return str(ip), int(port_hex, 16)


def listening_addresses(pid: int) -> set[tuple[str, int]]:
    """(host, port) of every TCP socket `pid` listens on (IPv4 and IPv6; an IPv4-mapped IPv6
    address as the IPv4 address)."""
    mine = _socket_inodes(pid)
    out = set()
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            with open(path) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == LISTEN and fields[9] in mine:
                out.add(_address(fields[1], family))
    return out
