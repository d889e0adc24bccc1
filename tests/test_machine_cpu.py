"""Machine-wide CPU accounting used by ltp-bench (issue 8: compare CPU per byte honestly)."""

import os

from ltp_tools.machine_cpu import cpu_s_per_gb, machine_cpu_s


def test_counts_busy_states_only(tmp_path):
    hz = os.sysconf("SC_CLK_TCK")
    # user nice system idle iowait irq softirq steal guest guest_nice
    p = tmp_path / "stat"
    p.write_text(f"cpu  {hz} {hz} {2 * hz} 5000 700 0 {3 * hz} 0 {hz} 0\ncpu0 1 2 3\n")
    # user + nice + system + softirq = 7 s; idle, iowait and guest (inside user) are not counted
    assert machine_cpu_s(str(p)) == 7.0


def test_unreadable_or_malformed_is_none(tmp_path):
    assert machine_cpu_s(str(tmp_path / "missing")) is None
    bad = tmp_path / "bad"
    bad.write_text("intr 1 2 3\n")
    assert machine_cpu_s(str(bad)) is None


def test_live_counter_is_monotonic():
    a = machine_cpu_s()
    sum(i * i for i in range(200_000))
    b = machine_cpu_s()
    assert a is not None and b is not None and b >= a


def test_per_gb():
    assert cpu_s_per_gb(2.0, 500_000_000) == 4.0
    assert cpu_s_per_gb(None, 10) is None
    assert cpu_s_per_gb(1.0, 0) is None
