"""``--num-servers K --colocate``: shard k on worker k's host (issue 11's RAT choice), planned and launched."""

from __future__ import annotations

import json
import subprocess

import pytest

from ltp_ps import cli, schedule_cli
from ltp_ps.errors import ConfigError
from ltp_ps.schedules import Topology, World, create
from ps_helpers import child_env, lab_reason, ps_cmd

pytestmark = pytest.mark.timeout(150)


def _args(*argv):
    return cli.build_parser().parse_args(["launch", *map(str, argv)])


def _rat(args, topology=None, n_elems=1200):
    k = args.num_servers
    shards = tuple((n_elems * s // k, n_elems * (s + 1) // k) for s in range(k))
    w = World(workers=range(args.workers), n_elems=n_elems, shards=shards, topology=topology,
              placement=schedule_cli.colocated_placement(args, topology))
    return w, create("rat", w)


@pytest.mark.parametrize("workers,k", [(4, 2), (4, 4), (6, 3), (3, 1)])
def test_without_a_topology_shard_k_shares_worker_k_host_and_roots_a_shorter_tree(workers, k):
    w, rat = _rat(_args("--workers", workers, "--num-servers", k, "--colocate", "--schedule", "rat"))
    _, apart = _rat(_args("--workers", workers, "--num-servers", k, "--schedule", "rat"))
    for s in range(k):
        assert w.host_of(f"server:{s}") == w.host_of(f"worker:{s}")
    for t, u in zip(rat.trees(), apart.trees()):
        # colocated: the shard is its rack's aggregator, every worker hands it its slice (chain 2);
        # on its own host it hangs above the rack, behind a worker aggregator (chain 4)
        assert t.chain_length() == 2 and u.chain_length() == 4
        assert {c for c, p, e in t.edges()} == {f"worker:{r}" for r in range(workers)}


def test_with_a_two_rack_topology_tree_k_is_rooted_in_worker_k_rack():
    topo = Topology.uniform([f"h{i}" for i in range(6)], racks=[3, 3])
    args = _args("--workers", 6, "--num-servers", 6, "--colocate", "--schedule", "rat")
    w, rat = _rat(args, topo)
    for s, t in enumerate(rat.trees()):
        assert w.host_of(f"server:{s}") == f"h{s}"
        rack = [f"worker:{r}" for r in (range(3) if s < 3 else range(3, 6))]
        # the root's own rack sends straight to it; the other rack goes through one aggregator
        assert sum(1 for c, p, e in t.edges() if p == t.root and c in rack) == 3
        assert t.chain_length() == 4


@pytest.mark.parametrize("argv, says", [
    (["--workers", 2, "--num-servers", 3, "--colocate"], "between 1 and --workers (2)"),
    (["--workers", 3, "--schedule", "ring", "--colocate"], "runs no PS"),
    (["--workers", 3, "--schedule", "hoplite", "--colocate"], "direct or rat"),
    (["--workers", 3, "--schedule", "mlfabric", "--colocate"], "direct or rat"),
])
def test_colocate_refuses_what_it_cannot_mean(argv, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        schedule_cli.check_colocate(_args(*argv))


def test_a_topology_without_a_host_per_worker_is_refused():
    topo = Topology.uniform(["a", "b"])
    with pytest.raises(ConfigError, match="one host per worker"):
        schedule_cli.colocated_placement(_args("--workers", 3, "--num-servers", 2, "--colocate"), topo)


def test_launch_refuses_before_spawning(capsys):
    assert cli.main(["launch", "--lab", "off", "--workers", "2", "--num-servers", "3", "--colocate"]) == cli.EXIT_CONFIG
    assert "--num-servers must be between 1 and --workers" in capsys.readouterr().err


@pytest.mark.parametrize("schedule", ["rat", "direct"])
def test_a_colocated_sharded_launch_trains(tmp_path, schedule):
    out = tmp_path / "s.json"
    p = subprocess.run(ps_cmd("launch", "--lab", "off", "--transport", "ltp", "--workers", 3, "--num-servers", 3,
                              "--colocate", "--schedule", schedule, "--epochs", 3, "--summary-json", out),
                       env=child_env(), capture_output=True, text=True, timeout=140)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "(shard k on worker k's host)" in p.stdout
    assert json.loads(out.read_text())["final_accuracy"] > 0.5  # shard 0 evaluates the assembled model


@pytest.mark.netns
def test_in_the_lab_shard_k_runs_in_worker_k_namespace(tmp_path):
    reason = lab_reason()
    if reason:
        pytest.skip(reason)
    metrics = tmp_path / "m.jsonl"
    p = subprocess.run(ps_cmd("launch", "--lab", "on", "--transport", "ltp", "--workers", 3, "--num-servers", 2,
                              "--colocate", "--schedule", "rat", "--iterations", 6, "--metrics", metrics),
                       env=child_env(), capture_output=True, text=True, timeout=140)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    ps_ip = {}
    for line in p.stdout.splitlines():
        if "] listening on ('" in line and line.startswith("[ps"):
            ps_ip[int(line[3:line.index("]")])] = line.split("('")[1].split("'")[0]
    for s, path in ((0, metrics), (1, tmp_path / "m.shard1.jsonl")):
        joins = {r["rank"]: r["addr"][0] for r in map(json.loads, path.read_text().splitlines())
                 if r.get("event") == "join"}
        assert len(joins) == 3
        assert joins[s] == ps_ip[s]  # worker s dialled from the shard's own namespace address
        assert len(set(joins.values())) == 3  # three hosts: no namespace of its own for a shard
