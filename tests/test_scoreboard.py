"""ltp-lab scoreboard: verdict logic with fake measurements (no lab), and one quick real row (netns)."""

import pytest

from ltp.config import Config
from ltp_tools.experiments import scoreboard as S
from ltp_tools.netlab import check_support

_problem = check_support()


def _fake_bench(table):
    def bench(*, transport, size, loss=0.0, rate_bps=None, delay_s=0.0, **kw):
        key = ("wan" if delay_s else "tbf" if rate_bps else "lossy" if loss else "clean", transport)
        gbps, cpu_per_gb = table[key]
        return dict(transport=transport, goodput_gbps=gbps, machine_cpu_s_per_gb=cpu_per_gb, duration_s=2.0,
                    sender_cpu_s=1.9)
    return bench


def _fake_incast(ltp_max, bbr_max, bound=1.0):
    def run(**kw):
        summ = []
        for loss in kw["losses"]:
            summ.append(dict(transport="ltp", loss=loss, bst_max_s=ltp_max, bst_p95_s=ltp_max, bst_median_s=ltp_max,
                             lower_bound_s=bound))
            summ.append(dict(transport="bbr", loss=loss, bst_max_s=bbr_max, bst_p95_s=bbr_max, bst_median_s=bbr_max,
                             lower_bound_s=bound))
        return dict(summary=summ, failures=[])
    return run


TABLE = {("clean", "ltp"): (3.0, 2.0), ("clean", "cubic"): (3.2, 1.8), ("lossy", "ltp"): (2.9, 2.1),
         ("lossy", "cubic"): (2.5, 2.0), ("lossy", "bbr"): (3.0, 2.0), ("tbf", "ltp"): (0.95, 3.0),
         ("wan", "ltp"): (0.80, 3.0), ("wan", "cubic"): (0.01, 3.0)}


ROUNDS = {("ltp", 0.0): (1.0, 0.99), ("bbr", 0.0): (1.2, 1.0), ("ltp", 0.01): (1.0, 0.90),
          ("bbr", 0.01): (1.1, 1.0), ("cubic", 0.01): (3.0, 1.0)}  # (transport, loss) -> (round s, delivered)


def _fake_job(tta_s, reach=None, rounds=ROUNDS):
    """A launch whose epochs are 10 s apart after the join at t=100; transport -> seconds to the accuracy.
    A job of ``iterations`` (the PS-round row) gets rounds of ``rounds[(transport, loss)]``, its first 3x slower."""
    def launch(transport, *, job, loss, seed=0):
        if "iterations" in job:
            sec, frac = rounds[(transport, loss)]
            return dict(rc=0, tail="", rows=[{"event": "iteration", "gather_s": sec * (3 if i == 0 else 1) / 2,
                                              "broadcast_s": sec * (3 if i == 0 else 1) / 2,
                                              "delivered": {str(w): frac for w in range(job["workers"])}}
                                             for i in range(job["iterations"])])
        t = tta_s[transport]
        rows = [{"event": "join", "t": 99.0}, {"event": "join", "t": 100.0}]
        rows += [{"event": "epoch", "epoch": e, "t": 100.0 + 10 * (e + 1),
                  "accuracy": 0.99 if t is not None and 10 * (e + 1) >= t else 0.1} for e in range(job["epochs"])]
        return dict(rc=0, rows=rows, tail="")
    return launch


def _fake_twins(loaded=None, rc=0, failed=()):
    return lambda: (loaded if loaded is not None else {"wire": True, "udpio": True},
                    {"rc": rc, "summary": "5 passed", "failed": list(failed)})


def test_verdicts_from_side_by_side_ratios(tmp_path):
    res = S.run(quick=True, out=str(tmp_path), progress=False, verbose=False, bench=_fake_bench(TABLE),
                incast_run=_fake_incast(1.05, 2.0), launch_job=_fake_job({"ltp": 10, "cubic": 20}),
                twins=_fake_twins(), broadcast=lambda transport, size, peers: {"duration_s": {"ltp": 1.2,
                                                                                             "cubic": 1.0}[transport]})
    v = {c["check"]: c["passed"] for c in res["checks"]}
    assert v["LTP/cubic machine CPU per GB"] is True          # 2.0/1.8 = 1.11 <= 1.25
    assert v["LTP/cubic goodput, 0% loss"] is True            # 3.0/3.2 = 0.94
    assert v["LTP/cubic goodput, 1% loss"] is True
    assert v["LTP/bbr goodput, 1% loss"] is False             # 2.9/3.0 < 1.0
    assert v["LTP 1% / LTP 0% goodput"] is True               # 2.9/3.0 = 0.967
    assert v["LTP goodput, 1 Gbit/s tbf, 1% loss (Gbit/s)"] is True
    assert v["LTP goodput, 1 Gbit/s + 10 ms, 1% loss (Gbit/s)"] is False
    assert v["LTP/cubic goodput, WAN 1% loss"] is True        # 80x
    detail = {c["check"]: c["detail"] for c in res["checks"]}
    assert detail["LTP goodput, 1 Gbit/s + 10 ms, 1% loss (Gbit/s)"] == "LTP sender CPU 95% of the transfer"
    assert v["LTP slowest / line-rate bound, 0.1%"] is True
    assert v["LTP/bbr slowest, 1.0%"] is True                 # 1.05/2.0
    assert v["LTP/cubic time to 0.3 accuracy, 1% loss"] is True  # 10 s / 20 s
    assert v["LTP broadcast / 4 cubic connections, time"] is False  # 1.2 > 1.0
    assert v["10MB: LTP/bbr round time, 0% loss"] is True      # 1.0 / 1.2 (the slow first round is skipped)
    assert v["10MB: LTP/bbr round time, 1% loss"] is False     # 1.0 / 1.1 > 0.8
    assert v["10MB: LTP/cubic round time, 1% loss"] is True    # 1.0 / 3.0
    assert v["10MB: LTP gather delivered, 0% loss"] is True    # 0.99 >= 0.98
    assert v["10MB: LTP gather delivered, 1% loss"] is False   # 0.90 < 0.95
    assert v["compiled ltp_ext modules loaded by default"] is True
    assert v["pure-Python twins pass CI's transport tests"] is True
    assert (tmp_path / "scoreboard.csv").exists() and (tmp_path / "results.json").exists()
    assert not res["failures"]


def test_time_to_accuracy_counts_from_the_last_join_and_a_run_that_never_gets_there_fails(tmp_path):
    from ltp_tools.experiments import scoreboard_rows as SR

    rows = [{"event": "join", "t": 5.0}, {"event": "join", "t": 7.0}, {"event": "epoch", "t": 9.0, "accuracy": 0.9},
            {"event": "epoch", "t": 12.0, "accuracy": 0.96}, {"event": "epoch", "t": 15.0, "accuracy": 0.97}]
    assert SR.time_to_accuracy(rows, 0.95) == 5.0 and SR.time_to_accuracy(rows, 0.99) is None
    assert SR.time_to_accuracy(rows[2:], 0.5) is None  # no join: no start
    res = S.run(rows=("tta",), quick=True, out=str(tmp_path), progress=False, verbose=False,
                launch_job=_fake_job({"ltp": None, "cubic": 10}))
    (c,) = res["checks"]
    assert c["passed"] is False and c["value"] is None and "ltp: never reached" in c["detail"]
    res = S.run(rows=("tta",), quick=True, out=str(tmp_path), progress=False, verbose=False,
                launch_job=_fake_job({"ltp": 20, "cubic": 20}))
    assert res["checks"][0]["passed"] is False and res["checks"][0]["value"] == 1.0  # 1.0 > 0.8


def test_twins_row_fails_on_a_twin_loaded_by_default_or_a_failing_twin_test(tmp_path):
    bad = "FAILED tests/test_engine.py::test_x - AssertionError: boom"
    res = S.run(rows=("twins",), out=str(tmp_path), progress=False, verbose=False,
                twins=_fake_twins({"wire": True, "udpio": False}, rc=1, failed=[bad]))
    v = {c["check"]: c for c in res["checks"]}
    assert v["compiled ltp_ext modules loaded by default"]["passed"] is False
    assert "udpio: TWIN" in v["compiled ltp_ext modules loaded by default"]["detail"]
    assert v["pure-Python twins pass CI's transport tests"]["passed"] is False and res["failures"]
    # the board names the failing test, in the row and in its failures
    assert bad in v["pure-Python twins pass CI's transport tests"]["detail"]
    assert any(bad in f["error"] for f in res["failures"])


def test_pytest_outcome_keeps_the_summary_and_the_failing_tests():
    from ltp_tools.experiments import scoreboard_rows as SR

    out = ("....F.E\n=== short test summary info ===\n"
           "FAILED tests/test_a.py::test_one - assert 1 == 2\nERROR tests/test_b.py::test_two - OSError\n"
           "1 failed, 5 passed, 1 error in 1.00s\n")
    got = SR.pytest_outcome(out)
    assert got["summary"] == "1 failed, 5 passed, 1 error in 1.00s"
    assert got["failed"] == ["FAILED tests/test_a.py::test_one - assert 1 == 2", "ERROR tests/test_b.py::test_two - OSError"]
    assert SR.pytest_outcome("") == {"summary": "", "failed": []}


def test_twin_test_list_is_the_one_ci_runs_and_the_compiled_path_is_the_default():
    from ltp_tools.experiments import scoreboard_rows as SR

    root = SR.repo_root()
    files = SR.twin_test_files(root)
    assert files and "tests/test_engine.py" in files and "tests/test_endpoint_cancel_clean.py" in files
    loaded = SR.compiled_default()
    assert loaded and all(loaded.values()), loaded  # the guard test's claim, seen from a fresh interpreter


def test_repeats_interleave_the_transports_and_judge_the_medians(tmp_path):
    """Three runs per transfer, LTP and cubic alternating; one LTP run an outlier each way. The verdict is the
    ratio of the medians (2.0 / 1.6 = 1.25: met), not of any single pair, and every run is kept."""
    calls = []
    ltp_cpu, cubic_cpu = iter([2.0, 5.0, 1.0]), iter([1.6, 1.5, 1.7])

    def bench(*, transport, size, **kw):
        calls.append(transport)
        cpu = next(ltp_cpu if transport == "ltp" else cubic_cpu)
        return dict(transport=transport, goodput_gbps=3.0, machine_cpu_s_per_gb=cpu, verified=True)

    res = S.run(rows=("cpu",), quick=True, out=str(tmp_path), progress=False, verbose=False, bench=bench, repeats=3)
    assert calls == ["ltp", "cubic"] * 3
    cpu = next(c for c in res["checks"] if c["check"] == "LTP/cubic machine CPU per GB")
    assert cpu["value"] == 1.25 and cpu["passed"] is True
    assert [r["machine_cpu_s_per_gb"] for r in res["raw"]["clean/ltp"]["runs"]] == [2.0, 5.0, 1.0]
    assert res["raw"]["clean/ltp"]["verified"] is True and res["params"]["repeats"] == 3
    assert res["table"].startswith("rows cpu: medians of 3 interleaved runs")


def test_broadcast_and_time_to_accuracy_rows_repeat_alternated_and_judge_their_medians(tmp_path):
    """With --repeats 3 the bcast and tta rows run LTP and cubic alternately three times each. One lucky or unlucky
    run (LTP's broadcast at 0.5 s, cubic's training that never reached the accuracy) does not decide the verdict."""
    calls = []
    durations = {"ltp": iter([1.5, 0.5, 1.4]), "cubic": iter([1.0, 1.1, 0.9])}

    def broadcast(*, transport, size, peers):
        calls.append(("bcast", transport))
        return {"duration_s": next(durations[transport]), "receivers": [{"wakeups": 1}]}

    tta = {"ltp": iter([20, 10, 10]), "cubic": iter([20, None, 10])}  # the quick job's epochs end at 10 and 20 s

    def launch(transport, *, job, loss, seed=0):
        calls.append(("tta", transport))
        return _fake_job({transport: next(tta[transport])})(transport, job=job, loss=loss, seed=seed)

    res = S.run(rows=("bcast", "tta"), quick=True, out=str(tmp_path), progress=False, verbose=False,
                broadcast=broadcast, launch_job=launch, repeats=3)
    assert calls == [("bcast", "ltp"), ("bcast", "cubic")] * 3 + [("tta", "ltp"), ("tta", "cubic")] * 3
    v = {c["row"]: c for c in res["checks"]}
    assert v["bcast"]["value"] == 1.4 and v["bcast"]["passed"] is False  # median 1.4 / median 1.0
    assert "medians of 3 and 3 runs" in v["bcast"]["detail"]
    assert [r["duration_s"] for r in res["raw"]["bcast/ltp"]["runs"]] == [1.5, 0.5, 1.4]
    # LTP's median 10 s; cubic's runs 20, never, 10: median 20 (a run that never got there is the slowest)
    assert v["tta"]["value"] == 0.5 and v["tta"]["passed"] is True
    assert "cubic 20.0, never, 10.0" in v["tta"]["detail"]
    raw = res["raw"]["tta"]
    assert raw["cubic"]["times_s"] == [20.0, None, 10.0] and raw["cubic"]["time_to_accuracy_s"] == 20.0
    assert raw["ltp"]["time_to_accuracy_s"] == 10.0 and len(raw["ltp"]["runs"]) == 3 and raw["ltp"]["rc"] == 0
    assert res["table"].startswith("rows bcast, tta: medians of 3 interleaved runs")


def test_the_table_says_how_repeats_were_judged(tmp_path):
    res = S.run(rows=("incast", "bcast"), quick=True, out=str(tmp_path), progress=False, verbose=False,
                incast_run=_fake_incast(1.0, 2.0), broadcast=lambda transport, size, peers: {"duration_s": 1.0},
                repeats=2)
    head = res["table"].splitlines()[:2]
    assert head == ["rows bcast: medians of 2 interleaved runs per point", "row incast: the rounds of 2 repeats"]
    res = S.run(rows=("incast",), quick=True, out=str(tmp_path), progress=False, verbose=False,
                incast_run=_fake_incast(1.0, 2.0), repeats=1)
    assert res["table"].startswith("|")  # one run: no header line


def test_time_to_accuracy_median_on_a_run_that_never_got_there_fails_naming_it(tmp_path):
    tta = {"ltp": iter([10, None, None]), "cubic": iter([20, 20, 20])}

    def launch(transport, *, job, loss, seed=0):
        return _fake_job({transport: next(tta[transport])})(transport, job=job, loss=loss, seed=seed)

    res = S.run(rows=("tta",), quick=True, out=str(tmp_path), progress=False, verbose=False, launch_job=launch,
                repeats=3)
    (c,) = res["checks"]
    assert c["passed"] is False and c["value"] is None
    assert c["detail"] == "ltp: 2 of 3 runs never reached 0.3"
    assert res["raw"]["tta"]["ltp"]["time_to_accuracy_s"] is None and not res["failures"]

    from ltp_tools.experiments import scoreboard_rows as SR
    assert SR._median_time([1.0, None]) is None and SR._median_time([1.0, 3.0]) == 2.0
    assert SR._median_time([]) is None and SR._median_time([None, 2.0, 1.0]) == 2.0


def test_a_broadcast_repeat_that_raises_is_a_failure_and_the_rest_still_count(tmp_path):
    n = iter(range(10))

    def broadcast(*, transport, size, peers):
        if next(n) == 2:
            raise RuntimeError("receiver 3 did not start")
        return {"duration_s": 2.0 if transport == "ltp" else 1.0}

    res = S.run(rows=("bcast",), quick=True, out=str(tmp_path), progress=False, verbose=False, broadcast=broadcast,
                repeats=2)
    assert [f["measurement"] for f in res["failures"]] == ["bcast/ltp"]
    assert "receiver 3 did not start" in res["failures"][0]["error"]
    (c,) = res["checks"]
    assert c["value"] == 2.0 and "medians of 1 and 2 runs" in c["detail"]
    assert res["raw"]["bcast/ltp"] == {"duration_s": 2.0}


def test_a_failed_time_to_accuracy_repeat_fails_the_board(tmp_path):
    n = iter(range(10))

    def launch(transport, *, job, loss, seed=0):
        r = _fake_job({transport: 10})(transport, job=job, loss=loss, seed=seed)
        return dict(r, rc=1, tail="worker 2 died") if next(n) == 2 else r

    res = S.run(rows=("tta",), quick=True, out=str(tmp_path), progress=False, verbose=False, launch_job=launch,
                repeats=2)
    assert [f["measurement"] for f in res["failures"]] == ["tta/ltp"]
    assert res["raw"]["tta"]["ltp"]["rc"] == 1 and res["raw"]["tta"]["ltp"]["times_s"] == [10.0, None]
    (c,) = res["checks"]
    assert c["value"] is None and c["detail"] == "ltp: 1 of 2 runs failed"


def test_a_failed_repeat_is_reported_and_the_rest_still_count(tmp_path):
    n = iter(range(10))

    def bench(*, transport, size, **kw):
        if next(n) == 1:
            raise RuntimeError("receiver did not start")
        return dict(transport=transport, goodput_gbps=0.95, machine_cpu_s_per_gb=3.0, duration_s=2.0,
                    sender_cpu_s=1.0)

    res = S.run(rows=("tbf",), quick=True, out=str(tmp_path), progress=False, verbose=False, bench=bench, repeats=3)
    assert [f["measurement"] for f in res["failures"]] == ["tbf/ltp"]
    assert len(res["raw"]["tbf/ltp"]["runs"]) == 2 and res["checks"][0]["value"] == 0.95


def test_a_transfer_that_reports_an_error_fails_the_board_whichever_repeat_it_is(tmp_path):
    """run_bench marks a reliable transfer that did not complete, or corrupted data, with ``error``; the board must
    fail on it, also when it is not the first of the repeats (whose other fields the merged figures show)."""
    n = iter(range(10))

    def bench(*, transport, size, **kw):
        r = dict(transport=transport, goodput_gbps=0.95, machine_cpu_s_per_gb=3.0, duration_s=2.0, sender_cpu_s=1.0,
                 verified=True)
        if next(n) == 2:
            r.update(verified=False, error="the transfer corrupted data")
        return r

    res = S.run(rows=("tbf",), quick=True, out=str(tmp_path), progress=False, verbose=False, bench=bench, repeats=3)
    assert res["failures"] == [dict(measurement="tbf/ltp", error="the transfer corrupted data")]
    assert [r["verified"] for r in res["raw"]["tbf/ltp"]["runs"]] == [True, True, False]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_repeats_must_be_a_positive_integer(tmp_path, bad):
    with pytest.raises(ValueError, match="repeats"):
        S.run(rows=("cpu",), quick=True, out=str(tmp_path), progress=False, verbose=False,
              bench=_fake_bench(TABLE), repeats=bad)


def test_the_cli_repeats_default_is_three_or_one_with_quick(monkeypatch):
    import argparse

    seen = []
    monkeypatch.setattr(S, "run", lambda **kw: seen.append(kw["repeats"]) or dict(failures=[]))
    ap = argparse.ArgumentParser()
    S.register(ap.add_subparsers())
    for argv, want in ((["scoreboard"], 3), (["scoreboard", "--quick"], 1), (["scoreboard", "--repeats", "5"], 5)):
        args = ap.parse_args(argv)
        assert args.func(args) == 0
        assert seen[-1] == want


def test_failed_measurement_is_reported_not_passed(tmp_path):
    def broken(**kw):
        raise RuntimeError("receiver died")
    res = S.run(rows=("tbf",), quick=True, out=str(tmp_path), progress=False, verbose=False, bench=broken,
                incast_run=_fake_incast(1, 1))
    assert res["failures"] and "receiver died" in res["failures"][0]["error"]
    assert [c["passed"] for c in res["checks"]] == [None]


def test_unknown_row_names_the_choices(tmp_path):
    with pytest.raises(ValueError, match="choose from cpu"):
        S.run(rows=("speed",), out=str(tmp_path), bench=_fake_bench(TABLE), incast_run=_fake_incast(1, 1))


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.skipif(_problem is not None, reason=f"network lab unavailable: {_problem}")
def test_quick_cpu_row_in_the_lab(tmp_path):
    res = S.run(rows=("cpu",), quick=True, out=str(tmp_path), progress=False, verbose=False)
    assert not res["failures"], res["failures"]
    for key in ("clean/ltp", "clean/cubic"):
        r = res["raw"][key]
        assert r["goodput_gbps"] > 0 and r["machine_cpu_s"] is not None and r["machine_cpu_s"] > 0
    assert all(c["value"] is not None for c in res["checks"])


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.skipif(_problem is not None, reason=f"network lab unavailable: {_problem}")
def test_quick_time_to_accuracy_row_in_the_lab(tmp_path):
    """Two real launches (LTP, TCP cubic; 2 workers, 2 epochs, 1 % loss at the PS): both train, both times exist."""
    res = S.run(rows=("tta",), quick=True, out=str(tmp_path), progress=False, verbose=False)
    assert not res["failures"], res["failures"]
    for tr in ("ltp", "cubic"):
        r = res["raw"]["tta"][tr]
        assert r["rc"] == 0 and len(r["epochs"]) == 2 and r["time_to_accuracy_s"] > 0
    assert res["checks"][0]["value"] is not None


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(_problem is not None, reason=f"network lab unavailable: {_problem}")
@pytest.mark.parametrize("transport, threads, connected", [("ltp", None, True), ("ltp", 0, True), ("ltp", 3, True),
                                                            ("ltp", None, False), ("cubic", None, True)])
def test_broadcast_bench_delivers_to_every_peer(transport, threads, connected):
    from ltp_tools import broadcast_bench as BB

    r = BB.run(transport=transport, size=3_000_000, peers=3, timeout=60, send_threads=threads, connected=connected)
    assert r["duration_s"] > 0 and r["peers"] == 3 and r["goodput_gbps"] > 0
    # no peer checked its bytes while the sender's clock ran (they share its cores)
    assert len(r["receivers"]) == 3 and all(rx["check_start_s"] >= r["clock_stop_s"] for rx in r["receivers"])
    if transport == "ltp":
        assert r["delivered"] == [1.0, 1.0, 1.0]
        assert r["send_threads"] == (Config().send_threads if threads is None else threads)
        # what each event loop did: every receiver read at least its share of DATA datagrams and sent ACKs, on
        # wake-ups it counted; the sender read those ACKs
        packets = -(-3_000_000 // Config().segment_size_for(1))  # DATA datagrams per copy of the (bytes) message
        assert len(r["receivers"]) == 3
        for rx in r["receivers"]:
            assert rx["datagrams_in"] >= packets and rx["datagrams_out"] >= 1
            assert rx["wakeups"]["readable"] + rx["wakeups"]["timer"] >= 1
        assert r["sender_datagrams_in"] >= 3 and r["sender_datagrams_out"] >= 3 * packets
        assert r["sender_wakeups"]["readable"] >= 1
        # each receiver's endpoint is connected to the sender's fixed port, or open to any peer (the sender then on
        # an ephemeral port)
        assert r["connected"] is connected and all(rx["connected"] is connected for rx in r["receivers"])
        assert (r["sender_port"] == BB.PORT + 1) is connected


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(_problem is not None, reason=f"network lab unavailable: {_problem}")
@pytest.mark.parametrize("transport", ["ltp", "ltp-one-socket", "ltp-connected", "cubic"])
def test_gather_bench_receives_every_senders_message_every_round(transport):
    from ltp_tools import gather_bench as GB

    r = GB.run(transport=transport, size=2_000_000, peers=3, rounds=3, timeout=60)
    assert r["transport"] == transport and r["peers"] == 3 and len(r["rounds"]) == 3
    for row in r["rounds"]:  # run() raises on a message that arrived incomplete or wrong
        assert row["gather_s"] > 0 and row["receiver_cpu_s"] >= 0 and row["sender_cpu_s"] > 0
        # /proc/stat counts in clock ticks (10 ms): a round of a few milliseconds may read 0
        assert row["machine_cpu_s"] is None or row["machine_cpu_s"] >= 0
        if transport.startswith("ltp"):
            assert row["delivered"] == [1.0, 1.0, 1.0]
            # the senders' own counters, summed: every datagram of three 2 MB messages went out
            assert row["sender_datagrams_out"] >= 3 * (2_000_000 // 1456 + 1)
            assert row["sender_syscalls"] > 0 and row["sender_wakeups"] > 0
            assert row["sender_retransmitted"] >= 0
    last = r["rounds"][-1]
    if transport == "ltp":  # across namespaces, every sender's datagrams came to its peer socket
        assert last["peer_socket_datagrams"] > 3 * 3 * 2_000_000 // 1500 and last["own_socket_datagrams"] == 0
    elif transport.startswith("ltp"):
        assert last["peer_socket_datagrams"] == 0 and last["own_socket_datagrams"] > 3 * 3 * 2_000_000 // 1500
    steady = sorted(row["gather_s"] for row in r["rounds"][1:])
    assert r["median"]["gather_s"] == pytest.approx((steady[0] + steady[1]) / 2)  # the cold first round left out
    assert r["goodput_gbps"] == pytest.approx(3 * 2_000_000 * 8 / r["median"]["gather_s"] / 1e9)


def test_gather_bench_refuses_an_empty_run():
    from ltp_tools import gather_bench as GB

    for kw in (dict(peers=0), dict(size=0), dict(rounds=0)):
        with pytest.raises(ValueError, match="need peers >= 1"):
            GB.run(**kw)


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(_problem is not None, reason=f"network lab unavailable: {_problem}")
def test_quick_ps_round_job_in_the_lab():
    from ltp_tools.experiments import scoreboard_rows as SR

    job = SR.PS_ROUND_QUICK[0]
    r = SR.launch_job("ltp", job=job, loss=0.01)
    assert r["rc"] == 0, r["tail"]
    st = SR.round_stats(r["rows"])
    assert st["rounds"] == job["iterations"] - 1 and st["round_s"] > 0 and 0.5 < st["delivered"] <= 1.0


def test_gro_reaches_every_single_flow_measurement_and_the_title(tmp_path):
    seen = []

    def bench(**kw):
        seen.append(kw.get("gro"))
        return _fake_bench(TABLE)(**kw)
    res = S.run(rows=("cpu", "loss", "tbf", "wan"), quick=True, out=str(tmp_path), progress=False, verbose=False,
                bench=bench, gro=True)
    assert seen and all(g is True for g in seen), seen
    assert res["params"]["gro"] is True and "receive GRO on" in res["table"].splitlines()[0]
    seen.clear()
    res = S.run(rows=("cpu",), quick=True, out=str(tmp_path), progress=False, verbose=False, bench=bench)
    assert seen == [False, False] and "GRO" not in res["table"]
