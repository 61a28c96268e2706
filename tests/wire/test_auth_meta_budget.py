"""Issue 31, finding 1: an AUTH frame's metadata is bounded like every other frame's. A bare
AUTH header claiming 16 MiB of metadata used to make the node allocate (and touch) 16 MiB and
hold it until the stall timeout; now the claim is refused at once, before a byte is buffered,
on a node without auth and from an authenticated (read-only) tenant alike."""

from __future__ import annotations

from tests.support.raw_protocol import AUTH, HEADER, LIMIT_EXCEEDED, MAGIC, RawConnection, raw_auth

MiB = 1 << 20
TOKEN = "reader-secret-0123456789"
AUTH_FILE = f"""
[tenants.reader]
token = "{TOKEN}"
roles = ["read"]
"""


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def claim_16_mib(conn: RawConnection) -> None:
    """Sends a bare AUTH header claiming 16 MiB of metadata; expects LIMIT_EXCEEDED and a close."""
    conn.send(HEADER.pack(MAGIC, 1, AUTH, 0, 7, 16 * MiB, 0, 0))
    frame = conn.recv_frame()  # the old node never answered (it waited for the 16 MiB)
    assert frame.status == LIMIT_EXCEEDED, frame
    assert "AUTH metadata" in frame.meta["error"]
    assert conn.closed_by_server()


def test_auth_claiming_16_mib_is_refused_at_once_without_auth(server_factory):
    node = server_factory(extra_args=["--stall-timeout-s", "60"])
    rss_before = rss_bytes(node.proc.pid)
    for _ in range(16):
        with RawConnection(node.port, timeout_s=20.0) as conn:
            claim_16_mib(conn)
    assert rss_bytes(node.proc.pid) - rss_before < 64 * MiB  # the old node: 16 x 16 MiB


def test_a_second_auth_from_a_read_only_tenant_cannot_claim_16_mib(server_factory, tmp_path):
    path = tmp_path / "auth.toml"
    path.write_text(AUTH_FILE)
    path.chmod(0o600)
    node = server_factory(extra_args=["--auth-file", str(path), "--stall-timeout-s", "60"])
    with raw_auth(RawConnection(node.port, timeout_s=20.0), TOKEN) as conn:
        claim_16_mib(conn)
