"""Every flag and config key used in deploy/ is accepted by the real gcache-server parser."""
from __future__ import annotations

import json
import re
import shlex
import tomllib

from conftest import REPO_ROOT
from gcache.server.config import build_parser, load_settings

DEPLOY = REPO_ROOT / "deploy"
EXAMPLE_CONFIG = DEPLOY / "gcache-server.toml"


def known_flags() -> set[str]:
    return {opt for action in build_parser()._actions for opt in action.option_strings}


def with_local_config(args: list[str]) -> list[str]:
    """Points --config at the repository's example (the deploy path doesn't exist here)."""
    out = list(args)
    for i, arg in enumerate(out[:-1]):
        if arg == "--config":
            out[i + 1] = str(EXAMPLE_CONFIG)
    return out


def assert_accepted(args: list[str], where: str) -> None:
    flags = [a.split("=", 1)[0] for a in args if a.startswith("--")]
    assert flags, f"{where}: no flags found"
    unknown = set(flags) - known_flags()
    assert not unknown, f"{where} uses flags gcache-server does not know: {sorted(unknown)}"
    load_settings(with_local_config(args))  # raises (or exits 2) on any bad value


def test_systemd_unit_flags():
    unit = (DEPLOY / "systemd" / "gcache-server.service").read_text()
    exec_lines = re.findall(r"^ExecStart=(.+)$", unit, re.M)
    assert len(exec_lines) == 1
    argv = shlex.split(exec_lines[0])
    assert argv[0].endswith("/gcache-server")
    assert_accepted(argv[1:], "systemd unit")
    assert re.search(r"^RestartPreventExitStatus=2 3$", unit, re.M)


def test_containerfile_flags():
    text = (DEPLOY / "Containerfile").read_text()
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.+\])$", text, re.M).group(1))
    cmd = json.loads(re.search(r"^CMD (\[.+\])$", text, re.M).group(1))
    assert entry[0].endswith("/gcache-server")
    assert_accepted(entry[1:] + cmd, "Containerfile")


def test_example_config_keys_are_flags_and_load():
    raw = tomllib.loads(EXAMPLE_CONFIG.read_text())
    flags = known_flags()
    for key in raw:
        assert "--" + key.replace("_", "-") in flags, f"config key {key!r} is not a gcache-server flag"
    settings = load_settings(["--config", str(EXAMPLE_CONFIG)])
    assert settings.memory == 16 << 30 and settings.data_dir == "/var/lib/gcache"


def test_command_line_overrides_config_file():
    settings = load_settings(["--config", str(EXAMPLE_CONFIG), "--memory", "2GiB", "--port", "9000"])
    assert settings.memory == 2 << 30 and settings.port == 9000
    assert settings.disk == 200 << 30  # still from the file
