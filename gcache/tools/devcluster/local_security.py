"""Credentials for a local cluster (tests, `gcache-cluster up --auth --tls`): an auth file
with one tenant per role, and a throwaway CA plus a master certificate made with the
openssl command. For real deployments see docs/security.md and deploy/README.md.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from pathlib import Path

AUTH_FILE = "auth.toml"
TENANTS = {"nodes": ["cluster"], "ops": ["admin"], "app": ["read", "write"]}
CERT_DAYS = 30


def write_auth_file(directory) -> Path:
    """DIR/auth.toml (mode 0600) with fresh random tokens, and DIR/<tenant>.token for each;
    kept if it already exists (a restarted cluster keeps its tokens)."""
    directory = Path(directory)
    path = directory / AUTH_FILE
    if path.exists():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    lines = []
    for name, roles in TENANTS.items():
        token = secrets.token_urlsafe(32)
        lines += [f"[tenants.{name}]", f'token = "{token}"', f"roles = {roles!r}".replace("'", '"'), ""]
        _write_private(directory / f"{name}.token", token + "\n")
    _write_private(path, "\n".join(lines))
    return path


def token(directory, tenant: str) -> str:
    return (Path(directory) / f"{tenant}.token").read_text().strip()


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _openssl(*args: str, cwd: Path) -> None:
    if shutil.which("openssl") is None:
        raise RuntimeError(
            "the openssl command is needed to make local TLS certificates; install it or run without --tls"
        )
    out = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args[:2])} failed: {out.stderr.strip()[-500:]}")


def make_pki(directory, hosts) -> dict:
    """A CA and one certificate for every master host (IP SANs), plus a client certificate.
    Returns the PEM paths: ca, cert, key, client_cert, client_key. Kept if present."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = {name: directory / f"{name}.pem" for name in ("ca", "cert", "key", "client_cert", "client_key")}
    if all(p.exists() for p in paths.values()):
        return {k: str(v) for k, v in paths.items()}
    san = ",".join([f"IP:{h}" for h in hosts] + ["DNS:localhost"])
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca-key.pem",
        "-out",
        "ca.pem",
        "-days",
        str(CERT_DAYS),
        "-subj",
        "/CN=gcache local CA",
        cwd=directory,
    )
    for cert, key, cn, ext in (
        ("cert.pem", "key.pem", "gcache-master", f"subjectAltName={san}"),
        ("client_cert.pem", "client_key.pem", "gcache-client", "extendedKeyUsage=clientAuth"),
    ):
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            key,
            "-out",
            f"{cn}.csr",
            "-subj",
            f"/CN={cn}",
            cwd=directory,
        )
        (directory / f"{cn}.ext").write_text(ext + "\n")
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{cn}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca-key.pem",
            "-CAcreateserial",
            "-out",
            cert,
            "-days",
            str(CERT_DAYS),
            "-extfile",
            f"{cn}.ext",
            cwd=directory,
        )
    for p in directory.glob("*key.pem"):
        p.chmod(0o600)
    return {k: str(v) for k, v in paths.items()}
