"""``ltp_ps.examples.lab_allreduce``: its modes are checked before any lab is built."""

import pytest

from ltp_ps.examples import lab_allreduce as LA


@pytest.mark.parametrize("mode, parsed", [("gloo", ("gloo", False, None)), ("ltp-hook", ("ltp", True, None)),
                                          ("gloo-hook@0.05", ("gloo", True, 0.05)), ("ltp@0", ("ltp", False, 0.0))])
def test_modes_parse(mode, parsed):
    assert LA.parse_mode(mode) == parsed


@pytest.mark.parametrize("mode", ["hook", "nccl", "ltp-hooks", "ltp-", "ltp@x", "gloo@1.5", "ltp@-0.1", ""])
def test_a_bad_mode_is_refused_before_the_lab(mode, monkeypatch, capsys):
    def no_lab(*a, **k):
        raise AssertionError("the lab was built for a bad mode")

    monkeypatch.setattr(LA, "Lab", no_lab)
    monkeypatch.setattr(LA, "check_support", no_lab)
    with pytest.raises(SystemExit) as exc:
        LA.main(["--modes", f"gloo,{mode}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "BACKEND[-hook][@LOSS]" in err or "must be a number in [0, 1)" in err
