"""Files only the daemon's own user may read (docs/security.md, "Files on disk").

The data dir holds every tenant's values (segments) and key names (warm.list), and an auth
file holds every token. The daemons call `private_umask()` first, so whatever they create is
0600 (files) / 0700 (directories) whatever umask they were started with; then
`prepare_private_dir()` for the data dir and `secret_file_problems()` for an auth file.
"""

from __future__ import annotations

import os
import stat
from typing import NamedTuple

PRIVATE_UMASK = 0o077
PRIVATE_DIR_MODE = 0o700
# Group or other may read or write: another local user could read values, or plant files.
_OTHERS_READ_WRITE = stat.S_IRGRP | stat.S_IWGRP | stat.S_IROTH | stat.S_IWOTH
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


class FileModeError(Exception):
    """A file or directory other users may read or write where only the owner should; the
    message says which, and the command that fixes it."""


class SecretFileProblems(NamedTuple):
    error: str | None  # refuse to start: others may write it, or another user owns it
    warning: str | None  # start, but say so: others may read it


def private_umask() -> int:
    """Sets the process umask to 0077 (returns the previous one)."""
    return os.umask(PRIVATE_UMASK)


def prepare_private_dir(path: str, what: str = "--data-dir") -> bool:
    """Creates `path` (and missing parents) mode 0700 where it does not exist; True if it did
    not. Raises FileModeError when an existing one can be read or written by other users (the
    message names the chmod), OSError when it cannot be created."""
    if not os.path.isdir(path):
        os.makedirs(path, mode=PRIVATE_DIR_MODE, exist_ok=True)
        os.chmod(path, PRIVATE_DIR_MODE)  # makedirs' mode is masked by the umask
        return True
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & _OTHERS_READ_WRITE:
        raise FileModeError(
            f"{what} {path} is mode {mode:04o}: other users can "
            f"{_what_others_can(mode)} the cache's values and key names; run `chmod 700 {path}` "
            "(and keep the service's UMask=0077)"
        )
    return False


def make_private_dir(path: str | os.PathLike[str]) -> None:
    """For launchers that own the directory (gcache.tools.devcluster): create it, or tighten an
    existing one, to mode 0700, so the daemon they start accepts it."""
    os.makedirs(path, mode=PRIVATE_DIR_MODE, exist_ok=True)
    os.chmod(path, PRIVATE_DIR_MODE)


def _what_others_can(mode: int) -> str:
    read = mode & (stat.S_IRGRP | stat.S_IROTH)
    write = mode & _OTHERS_WRITE
    return "read and write" if read and write else "read" if read else "write"


def secret_file_problems(path: str, what: str = "--auth-file", uid: int | None = None) -> SecretFileProblems:
    """What is wrong with a file of secrets: writable by group or others, or owned by another
    user who is not root, is an error (they could add a tenant); readable by others is a
    warning (a Kubernetes Secret is root-owned, often 0644). A missing file is not checked here."""
    try:
        st = os.stat(path)
    except OSError:
        return SecretFileProblems(None, None)
    me = os.geteuid() if uid is None else uid
    mode = stat.S_IMODE(st.st_mode)
    if mode & _OTHERS_WRITE:
        who = (
            "group and others"
            if mode & stat.S_IWGRP and mode & stat.S_IWOTH
            else ("its group" if mode & stat.S_IWGRP else "every user")
        )
        return SecretFileProblems(
            f"{what} {path} is mode {mode:04o}: writable by {who}, who could add a tenant; run `chmod 600 {path}`",
            None,
        )
    if st.st_uid not in (me, 0):
        return SecretFileProblems(
            f"{what} {path} is owned by uid {st.st_uid}, neither this user ({me}) nor root: that "
            f"user could add a tenant; run `chown {me} {path}` (or have root own it)",
            None,
        )
    if mode & stat.S_IROTH:
        return SecretFileProblems(None, f"{what} {path} is readable by every user: run `chmod 600 {path}`")
    return SecretFileProblems(None, None)
