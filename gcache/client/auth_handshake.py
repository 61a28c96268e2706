"""The client's half of a node's AUTH handshake (docs/protocol.md, "Authentication").

AUTH {} brings a fresh nonce; AUTH {"id", "mac"} answers it with an HMAC of the
token, so the token itself never crosses the wire. A node without --auth-file
answers {"auth": false} and the connection is used as it is.
"""

from __future__ import annotations

from gcache import errors
from gcache.wire.auth import NONCE_BYTES, auth_mac, token_id
from gcache.wire.protocol import FrameStatus, Opcode, encode_frame_head

_HANDSHAKE_REQUEST_ID = 0  # read back at once, before any pipelined request


def _exchange(conn, meta: dict) -> dict:
    conn.send([encode_frame_head(Opcode.AUTH, _HANDSHAKE_REQUEST_ID, meta)])
    opcode, _flags, _rid, meta_len, status, payload_len = conn.read_header()
    answer = conn.read_meta(meta_len)
    conn.skip(payload_len)
    if status == FrameStatus.OK and opcode == Opcode.AUTH:
        return answer
    conn.broken = True
    message = answer.get("error") if isinstance(answer.get("error"), str) else f"status {status}"
    if status == FrameStatus.UNAUTHENTICATED:
        raise errors.AuthError(
            f"gcache-server at {conn.address} rejected the token: {message}. Use a token listed in "
            "the node's --auth-file (gcache.Client(..., token=...) or GCACHE_TOKEN)",
            "unauthenticated",
            conn.address,
        )
    if status == FrameStatus.BUSY:  # authenticated, but the node's authenticated connections fill its caps
        raise errors.ServerBusyError(
            f"gcache-server at {conn.address} is at its connection limit ({message}); retry later, "
            "lower pool_size, or raise the server's --connections-max",
            conn.address,
        )
    if status == FrameStatus.UNKNOWN_OPCODE:
        raise errors.AuthError(
            f"gcache-server at {conn.address} does not know AUTH (an older version): it has no "
            "authentication; upgrade it, or connect without a token",
            "unauthenticated",
            conn.address,
        )
    raise errors.ProtocolError(f"gcache-server at {conn.address} answered AUTH with {message}")


def authenticate(conn, token: str) -> str | None:
    """Runs the handshake on a fresh connection; returns the tenant name, or None when the
    node has no authentication. Raises AuthError when the token is refused."""
    challenge = _exchange(conn, {})
    if challenge.get("auth") is False:
        return None
    nonce = challenge.get("nonce")
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        conn.broken = True
        raise errors.ProtocolError(f"gcache-server at {conn.address} sent a malformed AUTH challenge")
    answer = _exchange(conn, {"id": token_id(token), "mac": auth_mac(token, nonce)})
    tenant = answer.get("tenant")
    return tenant if isinstance(tenant, str) else ""
