"""The CLIs' flags are made from their config dataclasses' fields (gcache.common.flags): every
field is a flag or listed as not one, so the tables cannot drift; each flag's default is its
field's; and the helper's own rules."""

from __future__ import annotations

import argparse
import dataclasses
import operator

import pytest

from gcache.common.flags import FIELD_DEFAULT, add_flags, config_from_flags, field_default, flag, flag_fields, flag_of
from gcache.router.config import ROUTER_NOT_FLAGS, RouterConfig, add_router_args
from gcache.server.config import ServerSettings, build_parser, load_settings
from gcache.worker.engine.engine import EngineConfig
from gcache.worker.engine.scheduler import SchedulerConfig
from gcache.worker.http import flags as worker_flags
from gcache.worker.kvcache.tiered_config import TieredCacheConfig

# (config dataclass, its fields that are no flag, the parser its flags land in)
WORKER_PARSER = "gcache-worker"
CLI_CONFIGS = [
    (ServerSettings, (), "gcache-server"),
    (RouterConfig, ROUTER_NOT_FLAGS, "gcache-router"),
    (worker_flags.WorkerFlags, (), WORKER_PARSER),
    (EngineConfig, worker_flags.ENGINE_NOT_FLAGS, WORKER_PARSER),
    (SchedulerConfig, worker_flags.SCHEDULER_NOT_FLAGS, WORKER_PARSER),
    (TieredCacheConfig, worker_flags.CACHE_NOT_FLAGS, WORKER_PARSER),
]


def _router_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="gcache-router")
    add_router_args(ap)
    return ap


@pytest.fixture
def parsers() -> dict[str, argparse.ArgumentParser]:
    return {
        "gcache-server": build_parser(),
        "gcache-router": _router_parser(),
        WORKER_PARSER: worker_flags.build_parser(),
    }


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {opt: a for a in parser._actions for opt in a.option_strings}


@pytest.mark.parametrize("cls,not_flags,cli", CLI_CONFIGS, ids=lambda v: getattr(v, "__name__", None))
def test_every_field_is_a_flag_or_listed_as_not_one(cls, not_flags, cli, parsers):
    names = {f.name for f in dataclasses.fields(cls)}
    flagged = {f.name for f in dataclasses.fields(cls) if flag_of(f) is not None}
    assert flagged | set(not_flags) == names
    assert not flagged & set(not_flags)
    actions = _actions(parsers[cli])
    for f, fl in flag_fields(cls, not_flags):
        assert fl.option(f.name) in actions, f"{cls.__name__}.{f.name}: no {fl.option(f.name)} in {cli}"
        assert actions[fl.option(f.name)].dest == fl.dest_of(f.name)


@pytest.mark.parametrize("cls,not_flags,cli", CLI_CONFIGS[1:], ids=lambda v: getattr(v, "__name__", None))
def test_a_flag_left_out_gives_its_field_default(cls, not_flags, cli, parsers):
    """Router and worker flags default to their fields' defaults (through the flag's unit)."""
    args = parsers[cli].parse_args(
        [] if cls is not RouterConfig else ["--workers", "http://127.0.0.1:1"]  # a router needs workers
    )
    for f, fl in flag_fields(cls, not_flags):
        value = getattr(args, fl.dest_of(f.name))
        if fl.default is not FIELD_DEFAULT:
            assert value == fl.default, f.name
            continue
        if fl.to_field is not None:
            value = fl.to_field(value)
        elif fl.text:
            continue  # parsed by the CLI (RouterConfig.from_args), checked below
        assert value == field_default(f), f.name


def test_the_router_config_from_default_flags_is_the_default_config():
    args = _router_parser().parse_args(["--workers", "http://127.0.0.1:1"])
    assert RouterConfig.from_args(args) == RouterConfig(workers=("http://127.0.0.1:1",))


def test_the_worker_configs_from_default_flags_are_the_default_configs():
    args = worker_flags.parse_args([])
    args.prefetch_policy = "timeout"  # what check_role fills in for --role mixed
    sched = config_from_flags(SchedulerConfig, args, worker_flags.SCHEDULER_NOT_FLAGS)
    assert sched == SchedulerConfig()
    cache_config = config_from_flags(TieredCacheConfig, args, worker_flags.CACHE_NOT_FLAGS)
    assert cache_config == TieredCacheConfig()
    econf = config_from_flags(EngineConfig, args, worker_flags.ENGINE_NOT_FLAGS)
    assert econf == EngineConfig()


def test_server_flags_default_to_none_so_the_config_file_fills_them():
    args = build_parser().parse_args([])
    assert all(v is None for v in vars(args).values())
    assert load_settings([]) == ServerSettings()


def test_worker_flags_in_their_units_reach_the_configs():
    args = worker_flags.parse_args(
        ["--l2-mib", "1.5", "--no-layerwise-load", "--no-prefix-cache", "--l3", "127.0.0.1:7600", "--mtp-layers", "2"]
    )
    args.prefetch_policy = "timeout"
    cache_config = config_from_flags(TieredCacheConfig, args, worker_flags.CACHE_NOT_FLAGS, model_name="m")
    assert (cache_config.l2_bytes, cache_config.layerwise_load, cache_config.l3_url) == (
        int(1.5 * (1 << 20)),
        False,
        "127.0.0.1:7600",
    )
    econf = config_from_flags(EngineConfig, args, worker_flags.ENGINE_NOT_FLAGS, cache_config=cache_config)
    assert (econf.prefix_cache, econf.mtp_layers, econf.cache_config.model_name) == (False, 2, "m")


# ---- the helper's rules --------------------------------------------------------------------


@dataclasses.dataclass
class _Demo:
    port: int = dataclasses.field(default=7600, metadata=flag("the port"))
    ratio: float = dataclasses.field(default=0.5, metadata=flag(group="tuning"))
    name: str | None = dataclasses.field(default=None, metadata=flag(metavar="NAME"))
    fast: bool = dataclasses.field(default=True, metadata=flag())
    cache: bool = dataclasses.field(
        default=True, metadata=flag(name="--no-cache", dest="no_cache", action="store_true", to_field=operator.not_)
    )
    mib: int = dataclasses.field(
        default=2 << 20,
        metadata=flag(
            name="--mib",
            dest="mib",
            type=float,
            from_field=lambda n: n / (1 << 20),
            to_field=lambda m: int(m * (1 << 20)),
        ),
    )
    hidden: int = 3


def test_add_flags_names_types_and_defaults():
    ap = argparse.ArgumentParser()
    add_flags(ap, _Demo, not_flags=("hidden",))
    args = ap.parse_args([])
    assert vars(args) == {"port": 7600, "ratio": 0.5, "name": None, "fast": True, "no_cache": False, "mib": 2.0}
    args = ap.parse_args(["--port", "1", "--ratio", "2", "--name", "x", "--no-fast", "--no-cache", "--mib", "0.5"])
    assert config_from_flags(_Demo, args, ("hidden",)) == _Demo(1, 2.0, "x", False, False, 1 << 19)
    assert [g.title for g in ap._action_groups][-1] == "tuning"
    with pytest.raises(SystemExit):
        ap.parse_args(["--port", "x"])


def test_add_flags_without_defaults_leaves_every_flag_none():
    ap = argparse.ArgumentParser()
    add_flags(ap, _Demo, not_flags=("hidden",), defaults=False)
    assert all(v is None for v in vars(ap.parse_args([])).values())


def test_a_field_neither_flag_nor_listed_is_refused():
    with pytest.raises(TypeError, match="_Demo.hidden is neither a flag"):
        add_flags(argparse.ArgumentParser(), _Demo)
    with pytest.raises(TypeError, match="is a flag and also listed"):
        add_flags(argparse.ArgumentParser(), _Demo, not_flags=("hidden", "port"))
    with pytest.raises(TypeError, match="names no field"):
        add_flags(argparse.ArgumentParser(), _Demo, not_flags=("hidden", "gone"))
