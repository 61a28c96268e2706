"""What the tests share: process launchers built on gcache.tools.devcluster, raw protocol
clients, engine builders, and one wait helper. Imported as `tests.support.<module>` (the
repository root is on pytest's pythonpath, see pyproject.toml)."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
