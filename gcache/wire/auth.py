"""Tenants and tokens: the --auth-file of gcache-server and gcache-master, and
the client's side of the data port's challenge-response (docs/security.md).

An auth file is TOML, one table per tenant:

    [tenants.alice]
    token = "alice-secret-0123456789"   # shared secret, at least 16 characters
    roles = ["read", "write"]           # read / write / admin / cluster
    memory = "128MiB"                   # quota in the memory tier (optional)
    disk = "1GiB"                       # quota on disk; "0": never on disk (optional)

Roles: read (GET, EXISTS), write (PUT, REMOVE), admin (admin HTTP/gRPC state
changes: /flush, /drain, master Drain/Remove), cluster (node <-> node and node
<-> master: raw keys of every tenant, Register/Heartbeat).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import stat
import tomllib
from dataclasses import dataclass
from typing import Any

from gcache.common.units import parse_size
from gcache.errors import ConfigError

AUTH_DOMAIN = b"gcache-auth-v1\0"
TOKEN_ID_DOMAIN = b"gcache-token-id\0"
TOKEN_ID_BYTES = 16
NONCE_BYTES = 32
TOKEN_BYTES_MIN = 16
TOKEN_BYTES_MAX = 4096
ROLES = ("read", "write", "admin", "cluster")
TENANT_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,32}$")
TENANTS_MAX = 4096
TOKEN_ENV = "GCACHE_TOKEN"
TOKEN_FILE_ENV = "GCACHE_TOKEN_FILE"
# A tenant's keys are stored as name + NUL + key (the node's key namespace).
PREFIX_SEPARATOR = b"\0"


class AuthFileError(ValueError):
    """The auth file is unreadable or invalid; the message names the tenant and field."""


@dataclass(frozen=True)
class Tenant:
    name: str
    token: str
    roles: frozenset[str]
    memory: int | None = None  # quota bytes in the memory tier
    disk: int | None = None  # quota bytes on disk; 0 = never on disk

    def has(self, role: str) -> bool:
        return role in self.roles


def token_id(token: str | bytes) -> bytes:
    """What identifies a token on the wire: a hash, never the token itself."""
    raw = token.encode() if isinstance(token, str) else bytes(token)
    return hashlib.sha256(TOKEN_ID_DOMAIN + raw).digest()[:TOKEN_ID_BYTES]


def auth_mac(token: str | bytes, nonce: bytes) -> bytes:
    """The answer to a node's AUTH challenge: HMAC-SHA256(token, domain + nonce)."""
    raw = token.encode() if isinstance(token, str) else bytes(token)
    return hmac.new(raw, AUTH_DOMAIN + bytes(nonce), hashlib.sha256).digest()


def placement_key(stored_key: bytes) -> bytes:
    """The client's key of a key as an authenticated node stores it (prefix cut off):
    placement hashes what clients hash."""
    cut = stored_key.find(PREFIX_SEPARATOR)
    return stored_key[cut + 1 :] if cut >= 0 else stored_key


class AuthConfig:
    """The tenants of one auth file."""

    def __init__(self, tenants: dict[str, Tenant], path: str = ""):
        self.tenants = tenants
        self.path = path
        self._by_digest = {hashlib.sha256(t.token.encode()).digest(): t for t in tenants.values()}

    def by_token(self, token: str | None) -> Tenant | None:
        """The tenant holding `token` (compared as digests, so the lookup time does not
        depend on how much of a guess was right)."""
        if not token:
            return None
        return self._by_digest.get(hashlib.sha256(token.encode()).digest())

    def with_role(self, role: str) -> list[Tenant]:
        return sorted((t for t in self.tenants.values() if role in t.roles), key=lambda t: t.name)

    def cluster_token(self) -> str:
        """The token a node or master uses towards its peers: the first tenant (by name)
        with the cluster role. AuthFileError if there is none."""
        holders = self.with_role("cluster")
        if not holders:
            raise AuthFileError(
                f'auth file {self.path}: a cluster needs a tenant with roles = ["cluster"] '
                "(nodes use its token towards the masters and each other)"
            )
        return holders[0].token

    def native_tenants(self) -> list[dict[str, Any]]:
        """The list gcache._native.Server's "tenants" config key takes."""
        return [
            {"name": t.name, "token": t.token, "roles": sorted(t.roles), "memory": t.memory, "disk": t.disk}
            for t in sorted(self.tenants.values(), key=lambda t: t.name)
        ]


def _size(value: str | int, where: str) -> int:
    try:
        return parse_size(value)
    except ConfigError as e:
        raise AuthFileError(f"{where}: {e}") from None


def _tenant(name: str, table: object, path: str) -> Tenant:
    where = f"auth file {path}, tenant {name!r}"
    if not TENANT_NAME.match(name):
        raise AuthFileError(f"{where}: a tenant name is 1..32 of A-Z a-z 0-9 _ . -")
    if not isinstance(table, dict):
        raise AuthFileError(f"{where}: expected a table [tenants.{name}]")
    unknown = set(table) - {"token", "roles", "memory", "disk"}
    if unknown:
        raise AuthFileError(f"{where}: unknown field(s) {sorted(unknown)}; known: token, roles, memory, disk")
    token = table.get("token")
    if not isinstance(token, str) or not TOKEN_BYTES_MIN <= len(token.encode()) <= TOKEN_BYTES_MAX:
        raise AuthFileError(
            f"{where}: token must be a string of {TOKEN_BYTES_MIN}..{TOKEN_BYTES_MAX} bytes "
            "(e.g. from `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
        )
    roles = table.get("roles")
    if not isinstance(roles, list) or not roles or any(r not in ROLES for r in roles):
        raise AuthFileError(f"{where}: roles must be a non-empty list of {', '.join(ROLES)}; got {roles!r}")
    memory = _size(table["memory"], f"{where}, memory") if "memory" in table else None
    disk = _size(table["disk"], f"{where}, disk") if "disk" in table else None
    return Tenant(name, token, frozenset(roles), memory, disk)


def parse_auth(raw: dict[str, Any], path: str = "<auth file>") -> AuthConfig:
    unknown = set(raw) - {"tenants"}
    if unknown:
        raise AuthFileError(
            f"auth file {path}: unknown top-level key(s) {sorted(unknown)}; write one [tenants.NAME] table per tenant"
        )
    tables = raw.get("tenants")
    if not isinstance(tables, dict) or not tables:
        raise AuthFileError(f"auth file {path}: no tenants; write at least one [tenants.NAME] table")
    if len(tables) > TENANTS_MAX:
        raise AuthFileError(f"auth file {path}: {len(tables)} tenants, at most {TENANTS_MAX}")
    tenants = {name: _tenant(name, table, path) for name, table in tables.items()}
    seen: dict[str, str] = {}
    for t in tenants.values():
        if t.token in seen:
            raise AuthFileError(
                f"auth file {path}: tenants {seen[t.token]!r} and {t.name!r} share a token; "
                "a token must name one tenant"
            )
        seen[t.token] = t.name
    return AuthConfig(tenants, path)


def load_auth_file(path: str) -> AuthConfig:
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except OSError as e:
        raise AuthFileError(f"cannot read auth file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise AuthFileError(f"auth file {path} is not valid TOML: {e}") from None
    return parse_auth(raw, path)


PLACEHOLDER_PREFIX = "REPLACE-ME"


def placeholder_tenants(config: AuthConfig) -> list[str]:
    """Tenants whose token is still deploy/gcache-auth.example.toml's placeholder."""
    return sorted(t.name for t in config.tenants.values() if t.token.startswith(PLACEHOLDER_PREFIX))


def world_readable(path: str) -> bool:
    """True if users other than the owner (and group) may read the file: worth a warning."""
    try:
        return bool(os.stat(path).st_mode & stat.S_IROTH)
    except OSError:
        return False


def read_token_file(path: str) -> str:
    """A token from a file (surrounding whitespace dropped); ValueError if unreadable or empty."""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as e:
        raise ValueError(f"cannot read token file {path}: {e.strerror}") from None
    if not token:
        raise ValueError(f"token file {path} is empty")
    return token


def resolve_token(token: str | None = None) -> str | None:
    """`token`, else $GCACHE_TOKEN, else the file named by $GCACHE_TOKEN_FILE, else None."""
    if token:
        return token
    env = os.environ.get(TOKEN_ENV)
    if env:
        return env.strip()
    path = os.environ.get(TOKEN_FILE_ENV)
    return read_token_file(path) if path else None


def bearer_token(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` header, or None."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None
