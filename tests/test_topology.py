"""Topology: path rates/latencies over racks and uplinks, JSON round trip, failures, measurements."""

import json
import math

import pytest

from ltp_ps.schedules.base import World
from ltp_ps.schedules.topology import HostLink, Topology, Uplink


def racks33():
    return Topology.uniform([f"h{i}" for i in range(6)], rate_bps=100e6, latency_s=1e-4, racks=[3, 3],
                            uplink_bps=50e6, uplink_delay_s=2e-3)


def test_in_rack_and_cross_rack_paths():
    t = racks33()
    assert t.path_rate("h0", "h1") == 100e6
    assert t.path_rate("h0", "h4") == 50e6  # the uplink is the bottleneck
    assert t.path_latency("h0", "h1") == pytest.approx(2e-4)
    assert t.path_latency("h0", "h4") == pytest.approx(2e-4 + 4e-3)
    assert t.path_links("h0", "h4") == [("up", "h0"), ("uplink_up", 0), ("uplink_down", 1), ("down", "h4")]
    assert t.transfer_time("h0", "h1", 1_000_000) == pytest.approx(2e-4 + 0.08)
    assert t.racks() == {0: ["h0", "h1", "h2"], 1: ["h3", "h4", "h5"]}


def test_asymmetric_host_rates():
    t = Topology((HostLink("a", up_bps=10e6, down_bps=100e6), HostLink("b", up_bps=100e6, down_bps=1e6)))
    assert t.path_rate("a", "b") == 1e6
    assert t.path_rate("b", "a") == 100e6


def test_failed_pairs_and_measurements():
    t = racks33().with_failed([("h0", "h4")])
    assert not t.alive("h4", "h0") and t.alive("h0", "h1")
    assert t.path_rate("h0", "h4") == 0 and math.isinf(t.path_latency("h0", "h4"))
    m = t.with_measured({("h0", "h1"): (0.01, 5e6)})
    assert m.path_rate("h0", "h1") == 5e6 and m.path_latency("h0", "h1") == 0.005
    assert m.path_rate("h1", "h0") == 100e6  # direction matters
    f = Topology.from_measurements("a", {"b": (0.002, 20e6), "c": (0.004, 0.0)})
    assert f.path_rate("a", "b") == 20e6 and f.path_latency("a", "c") == 0.002


def test_json_round_trip_and_file(tmp_path):
    t = racks33().with_failed([("h1", "h5")]).with_measured({("h0", "h2"): (0.001, 3e6)})
    d = t.to_json()
    back = Topology.from_json(json.loads(json.dumps(d)))
    assert back.hosts == t.hosts and back.uplinks == t.uplinks and back.failed == t.failed
    assert back.measured == t.measured
    p = tmp_path / "topo.json"
    p.write_text(json.dumps({"rate_bps": 1e9, "hosts": ["a", {"name": "b", "rack": 1, "up_bps": 5e8}],
                             "uplinks": [{"rack": 1, "rate_bps": 2e8, "delay_s": 0.001}], "failed": [["a", "b"]]}))
    t2 = Topology.from_json(str(p))
    assert t2.host("b").up_bps == 5e8 and t2.host("b").down_bps == 1e9
    assert t2.uplink(1) == Uplink(1, 2e8, 2e8, 0.001)
    assert not t2.alive("a", "b")


def test_bad_input_names_the_fix(tmp_path):
    with pytest.raises(ValueError, match="hosts"):
        Topology.from_json({"racks": []})
    with pytest.raises(ValueError, match="cannot read"):
        Topology.from_json(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="duplicate"):
        Topology((HostLink("a"), HostLink("a")))
    with pytest.raises(ValueError, match="racks"):
        Topology.uniform(["a", "b"], racks=[3])
    with pytest.raises(ValueError, match="rates"):
        HostLink("x", up_bps=0)


def test_world_maps_nodes_to_hosts_in_launch_order():
    t = racks33().with_failed([("h1", "h4")])
    w = World(workers=range(5), n_elems=10, shards=((0, 10),), topology=t)
    assert w.host_of("server:0") == "h0" and w.host_of("worker:0") == "h1" and w.host_of("worker:4") == "h5"
    e = w.effective_topology()
    assert e.names == ["server:0"] + [f"worker:{i}" for i in range(5)]
    assert not e.alive("worker:0", "worker:3")  # h1 <-> h4
    assert e.rack_of("worker:2") == 1
    ring = World(workers=range(6), n_elems=10, topology=t)
    assert ring.host_of("worker:0") == "h0"
    with pytest.raises(KeyError, match="placement"):
        World(workers=range(7), n_elems=1, topology=t).host_of("worker:6")
    # one host per worker and a PS: colocated, shard k on worker k's host (what the lab's PS rows run)
    co = World(workers=range(6), n_elems=12, shards=((0, 6), (6, 12)), topology=t)
    assert [co.host_of(f"worker:{r}") for r in range(6)] == t.names
    assert co.host_of("server:0") == co.host_of("worker:0") and co.host_of("server:1") == co.host_of("worker:1")
    assert co.effective_topology().transfer_time("server:0", "worker:0", 1e6) < \
        co.effective_topology().transfer_time("server:0", "worker:3", 1e6)
