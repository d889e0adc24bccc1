"""Stage attribution of ``python -m ltp_tools.profile_transfer`` (pure parsing; the tool itself needs perf)."""

import pytest

from ltp_tools.profile_transfer import STAGES, classify, stage_shares

REPORT = """
# Samples: 1K of event 'cpu-clock:ppp'
#
    30.00%  libc.so.6                                   [.] __memmove_avx512_unaligned_erms
    20.00%  [kernel.kallsyms]                           [k] _copy_from_iter
    10.00%  [kernel.kallsyms]                           [k] clear_page_erms
    15.00%  [kernel.kallsyms]                           [k] __ip_append_data
    12.00%  libpython3.11.so.1.0                        [.] _PyEval_EvalFrameDefault
     8.00%  _datapath.cpython-311-x86_64-linux-gnu.so   [.] __pyx_f_7ltp_ext_9_datapath_10SendWindow__build_one
     5.00%  libm.so.6                                   [.] __sin_fma
"""


def test_stages_add_up_and_land_where_they_belong():
    s = stage_shares(REPORT)
    assert set(s) == set(STAGES)
    assert s["user copy"] == pytest.approx(0.30)
    assert s["kernel copy"] == pytest.approx(0.20)
    assert s["kernel page faults"] == pytest.approx(0.10)
    assert s["kernel net/syscall"] == pytest.approx(0.15)
    assert s["python"] == pytest.approx(0.12)
    assert s["ltp compiled"] == pytest.approx(0.08)
    assert s["other"] == pytest.approx(0.05)
    assert sum(s.values()) == pytest.approx(1.0)


def test_empty_report_is_all_zero():
    assert all(v == 0.0 for v in stage_shares("no samples\n").values())


@pytest.mark.parametrize("dso,sym,stage", [
    ("[kernel.kallsyms]", "_copy_to_iter", "kernel copy"),
    ("[kernel.kallsyms]", "udp_sendmsg", "kernel net/syscall"),
    ("libc.so.6", "__memcpy_avx_unaligned", "user copy"),
    ("libc.so.6", "pthread_mutex_lock", "other"),
    ("loop.cpython-311-x86_64-linux-gnu.so", "__pyx_f_6uvloop_4loop_x", "python"),
    ("_udpio.cpython-311-x86_64-linux-gnu.so", "x", "ltp compiled"),
])
def test_classify(dso, sym, stage):
    assert classify(dso, sym) == stage
