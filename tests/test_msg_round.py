"""``python -m ltp_tools.msg_round``: a PS round's per-message CPU, LTP against kernel TCP, on loopback.

The command's numbers are measurements (not asserted here); these tests pin that it moves every message of
every round exactly over both transports, reports one row per run and the ratio, and fails (exit 1, naming the
message) when a message arrives wrong, instead of timing a broken transfer.
"""

from __future__ import annotations

import json

import pytest

import ltp
from ltp_tools import msg_round

pytestmark = pytest.mark.timeout(120)


def _rows(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_both_transports_move_every_message_and_the_ratio_is_printed(capsys):
    assert msg_round.main(["--workers", "3", "--size", "20k", "--rounds", "4", "--warmup", "1",
                           "--repeats", "2"]) == 0
    rows = _rows(capsys.readouterr().out)
    runs = [r for r in rows if "transport" in r]
    assert [r["transport"] for r in runs] == ["ltp", "tcp", "ltp", "tcp"]  # alternated
    for r in runs:
        assert r["workers"] == 3 and r["size_bytes"] == 20_000 and r["rounds"] == 4
        assert r["cpu_ms_per_round"] > 0 and r["wall_ms_per_round"] > 0
        assert r["ready_notes"] is False
        assert r["cpu_us_per_message"] == pytest.approx(r["cpu_ms_per_round"] * 1e3 / 6)  # params + gradient each
    assert runs[0]["job_key"] is True and runs[1]["job_key"] is None
    ratio = rows[-1]
    assert ratio["repeats"] == 2 and ratio["ltp_over_tcp_cpu"] == pytest.approx(
        ratio["ltp_cpu_ms_per_round"] / ratio["tcp_cpu_ms_per_round"])


def test_the_round_before_session_54_with_ready_notes(capsys):
    assert msg_round.main(["--workers", "2", "--size", "3k", "--rounds", "3", "--warmup", "0", "--ready"]) == 0
    runs = [r for r in _rows(capsys.readouterr().out) if "transport" in r]
    assert [r["transport"] for r in runs] == ["ltp", "tcp"]
    for r in runs:
        assert r["ready_notes"] is True
        assert r["cpu_us_per_message"] == pytest.approx(r["cpu_ms_per_round"] * 1e3 / 6)  # 3 messages x 2 workers


def test_a_tcp_message_that_arrives_wrong_fails_the_run(monkeypatch, capsys):
    real = msg_round._recv_into

    async def corrupting(loop, sock, buf):
        await real(loop, sock, buf)
        buf[-1] ^= 0xFF

    monkeypatch.setattr(msg_round, "_recv_into", corrupting)
    assert msg_round.main(["--workers", "2", "--size", "5k", "--rounds", "2", "--warmup", "0",
                           "--transport", "tcp"]) == 1
    assert "arrived wrong" in capsys.readouterr().err


def test_one_datagram_messages_and_a_run_without_a_job_key(capsys):
    assert msg_round.main(["--workers", "1", "--size", "100", "--rounds", "3", "--warmup", "0",
                           "--transport", "ltp", "--no-key"]) == 0
    (row,) = _rows(capsys.readouterr().out)
    assert row["transport"] == "ltp" and row["job_key"] is False


def test_a_message_that_arrives_wrong_fails_the_run(monkeypatch, capsys):
    real = ltp.Endpoint.broadcast

    async def corrupting(self, peers, data, **kw):
        bad = bytearray(data)
        bad[100] ^= 0xFF
        return await real(self, peers, bytes(bad), **kw)

    monkeypatch.setattr(ltp.Endpoint, "broadcast", corrupting)
    assert msg_round.main(["--workers", "2", "--size", "5k", "--rounds", "2", "--warmup", "0",
                           "--transport", "ltp"]) == 1
    assert "parameters arrived wrong" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--workers", "0"], ["--rounds", "0"], ["--size", "10"], ["--transport", "udp"],
                                  ["--repeats", "0"], ["--warmup", "-1"], ["--size", "lots"]])
def test_bad_arguments_exit_2_naming_the_fix(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        msg_round.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and ("--" in err or "size" in err)
