"""`host:port` text, the one parser every flag, config field, map entry and URL goes through.

  parse_host_port("127.0.0.1:7600")  -> ("127.0.0.1", 7600)
  parse_host_port("[::1]:7600")      -> ("::1", 7600)
  parse_host_port("::1:7600")        -> ("::1", 7600)  (the last colon starts the port)
  join_host_port("::1", 7600)        -> "[::1]:7600"

Callers wrap the ValueError into their own error type (UsageError, ConfigError, MapError...).
"""

from __future__ import annotations

PORT_MIN, PORT_MAX = 1, 65535
EXAMPLE = "127.0.0.1:7600 or [::1]:7600"


def parse_host_port(text: str) -> tuple[str, int]:
    """(host, port) from 'host:port' or '[ipv6]:port' (brackets removed); ValueError saying what is wrong."""
    if not isinstance(text, str):
        raise ValueError(f"address must be a str 'host:port', got {type(text).__name__}")
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"address {text!r:.100} is not host:port, e.g. {EXAMPLE}")
    if not (port.isascii() and port.isdigit()) or not PORT_MIN <= int(port) <= PORT_MAX:
        raise ValueError(f"address {text!r:.100}: port must be a number in {PORT_MIN}..{PORT_MAX}")
    if host.startswith("[") or host.endswith("]"):
        if not (host.startswith("[") and host.endswith("]")) or len(host) == 2:
            raise ValueError(f"address {text!r:.100}: unbalanced or empty brackets, e.g. [::1]:7600")
        host = host[1:-1]
    return host, int(port)


def join_host_port(host: str, port: int) -> str:
    """The inverse of parse_host_port: an IPv6 host gets brackets (one that has them keeps them)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
