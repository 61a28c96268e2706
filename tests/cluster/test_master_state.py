"""The master's state machine, the leader's plan and the CLI checks, without Raft or processes."""

import random

import pytest

from gcache.cluster.cluster_map import ACTIVE, DEAD, DRAINING, JOINING, MapError
from gcache.master import main as master_main
from gcache.master.leader_duties import ACTIVATE, EXPIRE, FINISH_DRAIN, Action, LeaderDuties, plan, track_migrations
from gcache.master.raft_state import ReplicatedMap
from gcache.master.state import FAILED_PRECONDITION, INVALID_ARGUMENT, NOT_FOUND, UNKNOWN, MapState, StateError

ADDR = "10.0.0.1:7600"


def step(state: MapState, fn, *args):
    """Runs one command; checks the invariants and that the epoch rose by one iff something changed."""
    before = state.to_dict()
    result = fn(*args)
    state.check_invariants()
    change = result[1] if isinstance(result, tuple) else result
    assert state.map.epoch == before["map"]["epoch"] + (1 if change else 0), (fn.__name__, change)
    if not change:
        assert state.to_dict()["map"] == before["map"]
    return result


def joined(*ids) -> MapState:
    s = MapState()
    for i, node_id in enumerate(ids):
        step(s, s.register, node_id, f"10.0.0.{i + 1}:7600", 4, "")
    return s


# -- register --------------------------------------------------------------------


def test_register_new_node_joins_at_next_epoch():
    s = MapState()
    state, change = step(s, s.register, "n1", ADDR, 8, "10.0.0.1:7680")
    assert state == JOINING and "joining" in change
    node = s.node("n1")
    assert (node.address, node.weight, node.state, node.changed_epoch, node.admin) == (
        ADDR,
        8,
        JOINING,
        1,
        "10.0.0.1:7680",
    )
    assert s.rebalanced == {"n1": 0}


def test_register_same_live_node_again_changes_nothing():
    s = MapState()
    step(s, s.register, "n1", ADDR, 8, "")
    for _ in range(3):
        assert step(s, s.register, "n1", ADDR, 8, "") == (JOINING, None)
    assert s.map.epoch == 1


def test_register_live_node_with_new_address_or_weight_updates_it_in_place():
    s = joined("n1")
    step(s, s.activate, "n1", 1)
    state, change = step(s, s.register, "n1", "10.0.0.9:7600", 4, "")
    assert state == ACTIVE and change
    state, change = step(s, s.register, "n1", "10.0.0.9:7600", 16, "")
    assert state == ACTIVE and change
    assert (s.node("n1").address, s.node("n1").weight, s.node("n1").changed_epoch) == ("10.0.0.9:7600", 16, 4)


def test_register_dead_node_rejoins_with_new_entry_and_rebalanced_reset():
    s = joined("n1", "n2")
    step(s, s.heartbeat, "n1", 2, "")
    step(s, s.expire, "n1", 1)
    assert s.node("n1").state == DEAD
    state, change = step(s, s.register, "n1", "10.0.0.7:7600", 2, "")
    assert state == JOINING and "was dead" in change
    assert s.node("n1").address == "10.0.0.7:7600" and s.rebalanced["n1"] == 0


def test_register_draining_node_stays_draining():
    s = joined("n1")
    step(s, s.drain, "n1")
    assert step(s, s.register, "n1", "10.0.0.1:7600", 4, "") == (DRAINING, None)
    state, change = step(s, s.register, "n1", "10.0.0.5:7600", 4, "")
    assert state == DRAINING and change and s.node("n1").state == DRAINING


@pytest.mark.parametrize(
    "node_id,address,weight",
    [("", ADDR, 1), ("x" * 129, ADDR, 1), ("n1", "nohost", 1), ("n1", "h:0", 1), ("n1", ADDR, 0)],
)
def test_register_bad_fields_are_refused_and_change_nothing(node_id, address, weight):
    s = joined("n0")
    before = s.to_dict()
    with pytest.raises(StateError) as e:
        s.register(node_id, address, weight, "")
    assert e.value.code == INVALID_ARGUMENT
    assert s.to_dict() == before


# -- heartbeat -------------------------------------------------------------------


def test_heartbeat_unknown_and_dead_nodes():
    s = joined("n1")
    assert step(s, s.heartbeat, "nope", 0, "") == (UNKNOWN, None)
    step(s, s.expire, "n1", 1)
    assert step(s, s.heartbeat, "n1", 5, "") == (DEAD, None)
    assert s.rebalanced["n1"] == 0  # a dead node's reports are ignored


def test_heartbeat_records_rebalanced_epoch_without_changing_the_map():
    s = joined("n1")
    assert step(s, s.heartbeat, "n1", 1, "") == (JOINING, None)
    assert s.rebalanced == {"n1": 1}
    before = s.rebalanced
    step(s, s.heartbeat, "n1", 1, "")
    assert s.rebalanced is before  # steady heartbeats replace nothing
    step(s, s.heartbeat, "n1", 99, "")
    assert s.rebalanced == {"n1": 1}  # no node finished an epoch that does not exist


def test_degraded_heartbeat_drains_an_active_node_only():
    s = joined("n1", "n2")
    state, change = step(s, s.heartbeat, "n1", 0, "disk errors")
    assert state == JOINING and change is None  # a joining node is not drained
    step(s, s.activate, "n1", 1, True)
    state, change = step(s, s.heartbeat, "n1", 0, "disk errors")
    assert state == DRAINING and "disk errors" in change
    assert step(s, s.heartbeat, "n1", 0, "disk errors") == (DRAINING, None)


# -- drain / remove --------------------------------------------------------------


def test_drain_rules():
    s = joined("n1", "n2")
    with pytest.raises(StateError) as e:
        s.drain("nope")
    assert e.value.code == NOT_FOUND
    assert step(s, s.drain, "n1")
    assert s.node("n1").state == DRAINING
    assert step(s, s.drain, "n1") is None  # idempotent
    step(s, s.expire, "n2", 2)
    with pytest.raises(StateError) as e:
        s.drain("n2")
    assert e.value.code == FAILED_PRECONDITION


def test_remove_drops_node_and_its_rebalanced_epoch():
    s = joined("n1", "n2")
    with pytest.raises(StateError) as e:
        s.remove("nope")
    assert e.value.code == NOT_FOUND
    assert step(s, s.remove, "n1")
    assert s.node("n1") is None and "n1" not in s.rebalanced


# -- leader commands ---------------------------------------------------------------


def test_expire_live_node_dies_draining_node_leaves_stale_decision_is_noop():
    s = joined("n1", "n2")
    assert step(s, s.expire, "n1", 99) is None  # the leader saw another entry
    assert step(s, s.expire, "n1", 1)
    assert s.node("n1").state == DEAD
    assert step(s, s.expire, "n1", 3) is None  # dead already
    step(s, s.drain, "n2")
    assert step(s, s.expire, "n2", 4)
    assert s.node("n2") is None


def test_activate_waits_for_every_other_live_node_to_rebalance():
    s = joined("n1")
    assert step(s, s.activate, "n1", 1)  # alone: nothing to wait for
    step(s, s.register, "n2", "10.0.0.2:7600", 4, "")
    step(s, s.register, "n3", "10.0.0.3:7600", 4, "")
    assert (s.node("n2").changed_epoch, s.node("n3").changed_epoch) == (3, 4)
    assert not s.ready_to_activate("n2")
    assert step(s, s.activate, "n2", 3) is None
    step(s, s.heartbeat, "n1", 3, "")
    assert not s.ready_to_activate("n2")  # n3 (joining) has not reported yet
    step(s, s.heartbeat, "n3", 4, "")
    assert s.ready_to_activate("n2") and not s.ready_to_activate("n3")
    assert step(s, s.activate, "n2", 3)
    assert s.node("n2").state == ACTIVE
    assert step(s, s.activate, "n3", 4) is None
    assert step(s, s.activate, "n3", 4, True)  # migration timeout
    assert s.node("n3").state == ACTIVE


def test_finish_drain_waits_for_the_current_epoch_then_removes():
    s = joined("n1", "n2")
    step(s, s.drain, "n1")
    assert s.map.epoch == 3
    step(s, s.heartbeat, "n1", 2, "")
    assert step(s, s.finish_drain, "n1", 3) is None
    step(s, s.heartbeat, "n1", 3, "")
    assert step(s, s.finish_drain, "n1", 3)
    assert s.node("n1") is None
    step(s, s.drain, "n2")
    assert step(s, s.finish_drain, "n2", 5, True)  # timeout
    assert s.map.nodes == ()


# -- whole-state properties ------------------------------------------------------


def test_random_command_sequences_keep_invariants_and_are_deterministic():
    rng = random.Random(7)
    ids = [f"n{i}" for i in range(5)]
    a, b = MapState(), MapState()
    for _ in range(600):
        node_id = rng.choice(ids)
        cmd = rng.choice(["register", "heartbeat", "drain", "remove", "expire", "activate", "finish_drain"])
        node = a.node(node_id)
        changed = node.changed_epoch if node and rng.random() < 0.8 else rng.randrange(0, 50)
        args = {
            "register": (node_id, f"10.0.0.{rng.randrange(1, 3)}:7600", rng.choice([1, 4]), ""),
            "heartbeat": (node_id, rng.randrange(0, a.map.epoch + 2), rng.choice(["", "", "", "disk"])),
            "drain": (node_id,),
            "remove": (node_id,),
            "expire": (node_id, changed),
            "activate": (node_id, changed, rng.random() < 0.2),
            "finish_drain": (node_id, changed, rng.random() < 0.2),
        }[cmd]
        results = []
        for s in (a, b):
            try:
                results.append(step(s, getattr(s, cmd), *args))
            except StateError as e:
                results.append(("error", e.code))
                s.check_invariants()
        assert results[0] == results[1]
        assert a.to_dict() == b.to_dict()
    assert MapState.from_dict(a.to_dict()).to_dict() == a.to_dict()


def test_from_dict_rejects_a_broken_state():
    s = joined("n1")
    d = s.to_dict()
    d["rebalanced"]["ghost"] = 3
    with pytest.raises(MapError):
        MapState.from_dict(d)
    d = s.to_dict()
    d["map"]["nodes"][0]["changed_epoch"] = 9
    with pytest.raises(MapError):
        MapState.from_dict(d)


# -- the replicated wrapper, applied directly (as pysyncobj does) ---------------------


def test_replicated_map_stamps_heartbeats_and_never_raises():
    now = [100.0]
    changes = []
    rm = ReplicatedMap(on_change=lambda change, m: changes.append((m.epoch, change)), clock=lambda: now[0])
    ok, payload = rm.register("n1", ADDR, 4, "", _doApply=True)
    assert ok == "ok" and payload["state"] == JOINING and payload["map"].epoch == 1
    now[0] = 105.0
    assert rm.heartbeat("n1", 1, "", _doApply=True) == ("ok", {"epoch": 1, "state": JOINING})
    assert rm.snapshot().last_seen == {"n1": 105.0}
    assert rm.heartbeat("ghost", 1, "", _doApply=True) == ("ok", {"epoch": 1, "state": UNKNOWN})
    assert "ghost" not in rm.snapshot().last_seen
    assert rm.drain("ghost", _doApply=True)[:2] == ("error", NOT_FOUND)
    assert rm.register("n2", "bad", 4, "", _doApply=True)[:2] == ("error", INVALID_ARGUMENT)
    assert rm.remove("n1", _doApply=True)[0] == "ok"
    assert rm.snapshot().last_seen == {}
    assert changes == [(1, changes[0][1]), (2, changes[1][1])] and "removed" in changes[1][1]
    dump = rm._serialize()
    other = ReplicatedMap()
    other._deserialize(dump)
    assert other.snapshot().map == rm.snapshot().map


# -- the leader's plan -------------------------------------------------------------


def plan_for(s: MapState, last_seen, now, leader_since=0.0, started=None, hb=5.0, mig=60.0):
    started = track_migrations(s.map, started or {}, now) if started is None else started
    return plan(s.map, s.rebalanced, last_seen, started, now, leader_since, hb, mig)


def test_plan_expires_silent_nodes_only_after_the_grace():
    s = joined("n1", "n2")
    step(s, s.activate, "n1", 1, True)
    step(s, s.activate, "n2", 2, True)
    seen = {"n1": 100.0, "n2": 108.0}
    assert plan_for(s, seen, now=109.0, leader_since=106.0) == []  # in grace
    assert plan_for(s, seen, now=111.5, leader_since=106.0) == [Action(EXPIRE, "n1", 3)]
    assert plan_for(s, {}, now=111.5, leader_since=106.0) == [Action(EXPIRE, "n1", 3), Action(EXPIRE, "n2", 4)]


def test_plan_holds_back_expiring_more_than_half_of_the_live_nodes_at_once():
    s = joined("n1", "n2", "n3", "n4")
    for i, n in enumerate(("n1", "n2", "n3", "n4")):
        step(s, s.activate, n, s.map.node(n).changed_epoch, True)
    fresh = dict.fromkeys(("n1", "n2", "n3", "n4"), 110.0)
    one_silent = {**fresh, "n4": 100.0}
    assert [a.node_id for a in plan_for(s, one_silent, now=111.0)] == ["n4"]
    two_silent = {**one_silent, "n3": 100.0}
    assert [a.node_id for a in plan_for(s, two_silent, now=111.0)] == ["n3", "n4"]  # half: still
    three_silent = {**two_silent, "n2": 100.0}
    assert plan_for(s, three_silent, now=111.0) == []  # more than half: the master is cut off


def test_plan_ends_migrations_on_reports_or_timeout():
    s = joined("n1", "n2")
    seen = {"n1": 100.0, "n2": 100.0}
    step(s, s.activate, "n1", 1, True)  # epoch 3; n2 joining since epoch 2
    assert plan_for(s, seen, now=101.0) == []
    step(s, s.heartbeat, "n1", 2, "")
    assert plan_for(s, seen, now=101.0) == [Action(ACTIVATE, "n2", 2, forced=False)]
    started = {("n2", 2): 30.0}
    step(s, s.heartbeat, "n1", 0, "")
    assert plan_for(s, seen, now=101.0, started=started) == [Action(ACTIVATE, "n2", 2, forced=True)]
    step(s, s.activate, "n2", 2, True)
    step(s, s.drain, "n1")  # epoch 5
    assert plan_for(s, seen, now=101.0) == []
    step(s, s.heartbeat, "n1", 5, "")
    assert plan_for(s, seen, now=101.0) == [Action(FINISH_DRAIN, "n1", 5, forced=False)]


def test_track_migrations_keeps_running_clocks_and_forgets_finished_ones():
    s = joined("n1", "n2")
    clocks = track_migrations(s.map, {("n1", 1): 5.0, ("gone", 1): 1.0}, now=9.0)
    assert clocks == {("n1", 1): 5.0, ("n2", 2): 9.0}


class FakeRaft:
    """Just enough of MasterRaft for LeaderDuties: a local MapState, leadership by flag,
    and every node heartbeating at `now[0]` while `fresh`."""

    self_address = "r1"

    def __init__(self, state: MapState, now: list):
        self.state, self.now, self.leading, self.fresh = state, now, True, True

    def leader(self):
        return "r1" if self.leading else "r2"

    def term(self):
        return 1

    def is_leader(self):
        return self.leading

    def snapshot(self):
        from gcache.master.raft_state import Snapshot

        seen = {n.id: self.now[0] for n in self.state.map.nodes} if self.fresh else {}
        return Snapshot(self.state.map, self.state.rebalanced, seen)

    def apply(self, kind, node_id, changed_epoch, forced, timeout_s):
        if kind == EXPIRE:
            return self.state.expire(node_id, changed_epoch)
        return getattr(self.state, kind)(node_id, changed_epoch, forced)


def test_leader_duties_act_only_while_leading_and_restart_clocks_on_leader_change():
    s = joined("n1", "n2")  # both joining, neither has reported: only the timeout can end it
    now = [0.0]
    raft = FakeRaft(s, now)
    duties = LeaderDuties(raft, heartbeat_timeout_s=5.0, migration_timeout_s=10.0, tick_s=0.1, clock=lambda: now[0])
    assert duties.tick() == []
    raft.leading = False
    now[0] = 11.0  # past the timeout, but another replica leads
    assert duties.tick() == []
    raft.leading = True
    now[0] = 12.0  # this leadership restarts the migration clocks
    assert duties.tick() == []
    now[0] = 21.0
    assert duties.tick() == []
    now[0] = 22.5
    assert duties.tick() == [Action(ACTIVATE, "n1", 1, forced=True), Action(ACTIVATE, "n2", 2, forced=True)]
    assert [n.state for n in s.map.nodes] == [ACTIVE, ACTIVE] and s.map.epoch == 4
    raft.fresh = False  # silence: dead one heartbeat timeout after the last one seen
    now[0] = 30.0
    assert [a.kind for a in duties.tick()] == [EXPIRE, EXPIRE]
    assert [n.state for n in s.map.nodes] == [DEAD, DEAD]


# -- CLI argument checks -------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["--grpc", "nohost"],
        ["--raft", "h:70000"],
        ["--peers", "a:1,a:1"],
        ["--peers", "a:x"],
        ["--tick-s", "0"],
        ["--heartbeat-timeout-s", "-1"],
        ["--tick-s", "5", "--heartbeat-timeout-s", "5"],
        ["--grpc", "127.0.0.1:7000", "--raft", "127.0.0.1:7000"],
        ["--log-level", "loud"],
        ["--migration-timeout-s", "nan"],
    ],
)
def test_bad_arguments_exit_2(argv, tmp_path, capsys):
    try:
        code = master_main.main(argv + ["--data-dir", str(tmp_path / "d")])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    assert code == 2
    assert "error" in capsys.readouterr().err


def test_parser_defaults_and_peers_may_list_self():
    args = master_main.build_parser().parse_args(["--peers", "127.0.0.1:7701,10.0.0.2:7701"])
    assert (
        args.grpc,
        args.raft,
        args.data_dir,
        args.heartbeat_timeout_s,
        args.migration_timeout_s,
        args.tick_s,
        args.http,
        args.log_level,
    ) == ("127.0.0.1:7700", "127.0.0.1:7701", "./gcache-master-data", 5.0, 120.0, 0.2, "", "info")
    assert master_main.validate(args) == {"peers": ["10.0.0.2:7701"]}
