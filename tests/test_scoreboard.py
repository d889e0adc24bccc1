"""ltp-lab scoreboard: verdict logic with fake measurements (no lab), and one quick real row (netns)."""

import pytest

from ltp_tools.experiments import scoreboard as S
from ltp_tools.netlab import check_support

_problem = check_support()


def _fake_bench(table):
    def bench(*, transport, size, loss=0.0, rate_bps=None, delay_s=0.0, **kw):
        key = ("wan" if delay_s else "tbf" if rate_bps else "lossy" if loss else "clean", transport)
        gbps, cpu_per_gb = table[key]
        return dict(transport=transport, goodput_gbps=gbps, machine_cpu_s_per_gb=cpu_per_gb)
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


def test_verdicts_from_side_by_side_ratios(tmp_path):
    res = S.run(quick=True, out=str(tmp_path), progress=False, verbose=False, bench=_fake_bench(TABLE),
                incast_run=_fake_incast(1.05, 2.0))
    v = {c["check"]: c["passed"] for c in res["checks"]}
    assert v["LTP/cubic machine CPU per GB"] is True          # 2.0/1.8 = 1.11 <= 1.25
    assert v["LTP/cubic goodput, 0% loss"] is True            # 3.0/3.2 = 0.94
    assert v["LTP/cubic goodput, 1% loss"] is True
    assert v["LTP/bbr goodput, 1% loss"] is False             # 2.9/3.0 < 1.0
    assert v["LTP 1% / LTP 0% goodput"] is True               # 2.9/3.0 = 0.967
    assert v["LTP goodput, 1 Gbit/s tbf, 1% loss (Gbit/s)"] is True
    assert v["LTP goodput, 1 Gbit/s + 10 ms, 1% loss (Gbit/s)"] is False
    assert v["LTP/cubic goodput, WAN 1% loss"] is True        # 80x
    assert v["LTP slowest / line-rate bound, 0.1%"] is True
    assert v["LTP/bbr slowest, 1.0%"] is True                 # 1.05/2.0
    assert (tmp_path / "scoreboard.csv").exists() and (tmp_path / "results.json").exists()
    assert not res["failures"]


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
