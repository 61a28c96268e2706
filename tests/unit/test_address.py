"""gcache.common.address: the one host:port parser, and each caller keeping its own error type."""

from __future__ import annotations

import ast

import pytest

from gcache import errors
from gcache.client.connection import parse_address
from gcache.cluster.cluster_map import ACTIVE, MapError, NodeInfo
from gcache.cluster.master_api import parse_master_url
from gcache.common.address import join_host_port, parse_host_port
from gcache.master import main as master_main
from gcache.server.config import _is_host_port
from tests.support.package_source import PACKAGE, parsed

GOOD = [
    ("127.0.0.1:7600", ("127.0.0.1", 7600)),
    ("localhost:1", ("localhost", 1)),
    ("node-a.example.org:65535", ("node-a.example.org", 65535)),
    ("[::1]:7600", ("::1", 7600)),
    ("[fe80::1%eth0]:80", ("fe80::1%eth0", 80)),
    ("::1:7600", ("::1", 7600)),  # bare IPv6: the last colon starts the port
    ("10.0.0.1:007", ("10.0.0.1", 7)),
]

BAD = [
    ("", "not host:port"),
    ("7600", "not host:port"),
    (":7600", "not host:port"),
    ("host:", "port must be a number in 1..65535"),
    ("host:0", "port must be a number in 1..65535"),
    ("host:65536", "port must be a number in 1..65535"),
    ("host:-1", "port must be a number in 1..65535"),
    ("host: 80", "port must be a number in 1..65535"),
    ("host:80 ", "port must be a number in 1..65535"),
    ("host:\uff18\uff10", "port must be a number in 1..65535"),  # fullwidth digits are not a port
    ("host:\u00b2", "port must be a number in 1..65535"),  # isdigit() alone would pass this
    ("[::1:7600", "unbalanced or empty brackets"),
    ("::1]:7600", "unbalanced or empty brackets"),
    ("[]:7600", "unbalanced or empty brackets"),
    ("[::1]", "port must be a number in 1..65535"),
]


@pytest.mark.parametrize("text, expected", GOOD)
def test_parses_host_and_port(text, expected):
    assert parse_host_port(text) == expected


@pytest.mark.parametrize("text, why", BAD)
def test_rejects_with_a_message_that_says_why(text, why):
    with pytest.raises(ValueError) as caught:
        parse_host_port(text)
    assert why in str(caught.value)
    assert repr(text)[:40] in str(caught.value)  # names the text it could not parse


@pytest.mark.parametrize("value", [7600, None, b"127.0.0.1:7600", ("127.0.0.1", 7600)])
def test_rejects_what_is_not_a_str(value):
    with pytest.raises(ValueError, match="must be a str"):
        parse_host_port(value)


def test_join_is_the_inverse_and_brackets_ipv6():
    assert join_host_port("127.0.0.1", 7600) == "127.0.0.1:7600"
    assert join_host_port("::1", 7600) == "[::1]:7600"
    assert join_host_port("[::1]", 7600) == "[::1]:7600"  # already bracketed: kept once
    for text, (host, port) in GOOD:
        assert parse_host_port(join_host_port(host, port)) == (host, port)


def test_each_caller_keeps_its_own_error_type():
    assert parse_address("[::1]:7600") == ("::1", 7600)
    with pytest.raises(errors.InvalidArgumentError, match="must look like host:port"):
        parse_address("127.0.0.1:70000")
    assert parse_master_url("gcache://[::1]:7700, 127.0.0.2:7700") == ["[::1]:7700", "127.0.0.2:7700"]
    with pytest.raises(errors.InvalidArgumentError, match="is not host:port"):
        parse_master_url("gcache://127.0.0.1:7700,nowhere")
    assert master_main._host_port(" 127.0.0.1:7700 ", "--grpc") == ("127.0.0.1", 7700)
    with pytest.raises(master_main.UsageError, match="--raft"):
        master_main._host_port("127.0.0.1:0", "--raft")
    NodeInfo("n1", "[::1]:7600", 1, ACTIVE).validate()
    with pytest.raises(MapError, match="n1: address"):
        NodeInfo("n1", "127.0.0.1", 1, ACTIVE).validate()
    assert _is_host_port("10.0.0.1:7600") and not _is_host_port("10.0.0.1:port")


def test_no_other_module_splits_host_port_itself():
    """The parser has one home: product code never rpartitions / rsplits an address on ':'."""
    offenders = []
    for path, tree in parsed().items():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("rpartition", "rsplit")
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and node.args[0].value == ":"
            ):
                offenders.append(str(path.relative_to(PACKAGE.parent)))
    assert offenders == ["gcache/common/address.py"]
