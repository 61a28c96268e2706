"""gcache-server's eviction settings, end to end: flags, config file, validation, and the
chain policy seeing PUT_BATCH chains and EXISTS_BATCH prefixes through a real server."""

import tempfile

import pytest

import gcache
from gcache.server.config import ConfigError, load_settings
from tests.support.servers import run_server_cli

PAGE = 4096
FLAGS = [
    "--eviction-policy",
    "--eviction-fresh-weight",
    "--eviction-ghost-factor",
    "--eviction-tail-hint",
    "--no-eviction-tail-hint",
    "--eviction-small-queue-fraction",
    "--disk-exclusive",
    "--no-disk-exclusive",
]


@pytest.mark.process
def test_help_names_every_eviction_flag():
    out = run_server_cli("--help", check=True).stdout
    for flag in FLAGS:
        assert flag in out


def test_defaults_and_native_config():
    s = load_settings([])
    native = s.native_config()
    assert (
        native["eviction_policy"],
        native["eviction_fresh_weight"],
        native["eviction_ghost_factor"],
        native["eviction_tail_hint"],
        native["small_queue_fraction"],
        native["disk_exclusive"],
    ) == ("chain", 0.0, 2.0, True, 0.10, True)


def test_flags_and_config_file(tmp_path):
    conf = tmp_path / "node.toml"
    conf.write_text('eviction-policy = "s3fifo"\neviction_small_queue_fraction = 0.25\ndisk-exclusive = false\n')
    s = load_settings(["--config", str(conf), "--eviction-fresh-weight", "4", "--no-eviction-tail-hint"])
    native = s.native_config()
    assert (
        native["eviction_policy"],
        native["small_queue_fraction"],
        native["disk_exclusive"],
        native["eviction_fresh_weight"],
        native["eviction_tail_hint"],
    ) == ("s3fifo", 0.25, False, 4.0, False)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--eviction-fresh-weight", "0.5"], "--eviction-fresh-weight"),
        (["--eviction-fresh-weight", "100"], "--eviction-fresh-weight"),
        (["--eviction-ghost-factor", "-1"], "--eviction-ghost-factor"),
        (["--eviction-small-queue-fraction", "0.95"], "--eviction-small-queue-fraction"),
    ],
)
def test_bad_values_are_refused_with_the_flag_named(argv, message):
    with pytest.raises(ConfigError, match=message):
        load_settings(argv)


def test_unknown_policy_is_a_usage_error(tmp_path):
    conf = tmp_path / "node.toml"
    conf.write_text('eviction-policy = "arc"\n')
    with pytest.raises(ConfigError, match="--eviction-policy"):
        load_settings(["--config", str(conf)])
    with pytest.raises(SystemExit) as exc:
        load_settings(["--eviction-policy", "arc"])
    assert exc.value.code == 2


def chain_keys(name: str, n: int) -> list[bytes]:
    return [b"%s-%03d" % (name.encode(), i) for i in range(n)]


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("policy, a_prefix, b_prefix", [("chain", 1, 127), ("lru", 0, 128)])
def test_the_server_passes_chains_and_prefixes_to_the_policy(server_factory, policy, a_prefix, b_prefix, transport):
    # 1 MiB of memory = 256 values of 4 KiB. Two chains of 128 fill it; 128 single puts then
    # push 128 values out. chain: B's tail (a partial block), then A deepest first, so A
    # keeps its head. lru: A, oldest first, goes whole.
    # shm: the batch goes as several RESERVE/COMMITs (128 KiB chunks here), still one chain.
    sock = tempfile.mkdtemp(prefix="gce") + "/s.sock"
    server = server_factory(
        memory="1MiB",
        disk="0",
        extra_args=["--eviction-policy", policy, "--eviction-fresh-weight", "1", "--unix-socket", sock],
    )
    value = bytes(PAGE)
    a, b = chain_keys("a", 128), chain_keys("b", 128)
    with gcache.Client(server.address, transport=transport) as client:
        assert all(client.put_batch(a, [value] * 128))
        assert all(client.put_batch(b, [value] * 128))
        for i in range(128):
            assert client.put(b"single-%03d" % i, value)
        assert client.batch_exists_prefix(a) == a_prefix
        assert client.batch_exists_prefix(b) == b_prefix
        gauges = client.stats()["gauges"]
        assert gauges["keys"] == 256
        if policy == "chain":
            assert gauges["eviction_fresh_weight_pct"] == 100
        else:
            assert "eviction_fresh_weight_pct" not in gauges


def test_the_default_server_tunes_its_weight(server_factory):
    server = server_factory(memory="1MiB", disk="0")
    with gcache.Client(server.address) as client:
        gauges = client.stats()["gauges"]
        assert gauges["eviction_tuner_lru"] == 1  # the tuner's starting point: plain LRU
        assert gauges["eviction_fresh_weight_pct"] == 100
        assert gauges["eviction_tuner_epochs"] == 0
        value = bytes(PAGE)
        for i in range(600):  # 2.3 memory tiers of one-off puts: epochs pass
            client.put(b"once-%d" % i, value)
        assert client.stats()["gauges"]["eviction_tuner_epochs"] >= 2
