"""Planning-time benchmark of MLfabric's batch planner (issue 9: plan 30 updates in < 50 ms).

``python -m ltp_tools.mlfabric_bench [--updates 30] [--aggregators 3] [--repeat 30] [--budget-ms 50]``

Each repetition draws a seeded batch (worker rates from a skewed profile like the paper's N3, sizes 4-12.5
MB, versions spread over ``tau_max``), builds a fresh reservation table holding some in-flight traffic,
and times :func:`ltp_ps.schedules.mlfabric.plan_batch` (Alg 2 ordering + Alg 3 aggregation) with
``time.perf_counter``.  Prints min / median / p90 in ms (and JSON with ``--json``); exits 1 when the
median misses ``--budget-ms``.  The machine is shared: compare numbers from one run only.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from ltp_ps.schedules.mlfabric import Update, plan_batch
from ltp_ps.schedules.mlfabric_links import FabricNetwork, ReservationTable

MBIT = 1e6 / 8  # bytes/s per Mbit/s
PROFILE_MBIT = (100, 250, 500, 1000, 10000)  # host rates, skewed towards the fast end (paper's N3 shape)
PROFILE_WEIGHTS = (0.1, 0.1, 0.1, 0.2, 0.5)
SIZES = (4_000_000, 8_000_000, 12_500_000)  # bytes per update
PS = "server:0"


def make_batch(n: int, seed: int, tau_max: int):
    """A seeded batch of ``n`` updates, its network and a table with some traffic in flight."""
    rng = random.Random(seed)
    workers = [f"worker:{i}" for i in range(n)]
    hosts = [PS] + workers

    def rate():
        return rng.choices(PROFILE_MBIT, PROFILE_WEIGHTS)[0] * MBIT

    net = FabricNetwork({h: rate() for h in hosts}, {h: rate() for h in hosts})
    net = net.with_rates({PS: 10000 * MBIT}, {PS: 10000 * MBIT})
    table = ReservationTable.for_network(net, now=0.0)
    for w in rng.sample(workers, max(1, n // 5)):  # earlier batches' transfers still running
        table.reserve(net.path(w, PS), rng.choice(SIZES), 0.0)
    v_init = 1000
    ups = [Update(w, rng.choice(SIZES), v_init - rng.randint(0, tau_max), seq=i) for i, w in enumerate(workers)]
    return net, table, ups, v_init, workers


def time_plans(n: int = 30, k: int = 3, repeat: int = 30, tau_max: int = 32, seed: int = 0) -> list[float]:
    """Seconds per ``plan_batch`` call over ``repeat`` seeded batches."""
    out = []
    for r in range(repeat):
        net, table, ups, v_init, workers = make_batch(n, seed + r, tau_max)
        t0 = time.perf_counter()
        plan_batch(ups, table, net, PS, now=0.0, tau_max=tau_max, v_init=v_init, aggregators=workers, k=k,
                   rng=random.Random(seed + r))
        out.append(time.perf_counter() - t0)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ltp_tools.mlfabric_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--updates", type=int, default=30)
    ap.add_argument("--aggregators", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--tau-max", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-ms", type=float, default=50.0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.updates < 1 or a.repeat < 1:
        ap.error("--updates and --repeat must be >= 1")
    ts = sorted(t * 1e3 for t in time_plans(a.updates, a.aggregators, a.repeat, a.tau_max, a.seed))
    res = {"updates": a.updates, "aggregators": a.aggregators, "repeat": a.repeat, "min_ms": ts[0],
           "median_ms": statistics.median(ts), "p90_ms": ts[int(0.9 * (len(ts) - 1))], "budget_ms": a.budget_ms}
    res["ok"] = res["median_ms"] <= a.budget_ms
    if a.json:
        print(json.dumps(res))
    else:
        print(f"plan_batch: {a.updates} updates, k={a.aggregators}, {a.repeat} batches: min {res['min_ms']:.1f} ms, "
              f"median {res['median_ms']:.1f} ms, p90 {res['p90_ms']:.1f} ms (budget {a.budget_ms:.0f} ms: "
              f"{'met' if res['ok'] else 'MISSED'})")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
