"""Rendezvous through torch's TCPStore: publishing, HMAC authentication, admission checks."""

from __future__ import annotations

import json
import socket

import pytest

from ltp_ps import rendezvous as rdv
from ltp_ps.errors import AuthError, ConfigError, MembershipError, RendezvousError

pytestmark = pytest.mark.timeout(60)


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def stores():
    port = _port()
    master = rdv.make_store("127.0.0.1", port, is_master=True, timeout_s=5)
    client = rdv.make_store("127.0.0.1", port, is_master=False, timeout_s=5)
    yield rdv.prefixed(master, "t"), rdv.prefixed(client, "t")


def _info(**kw):
    d = dict(shard=0, num_servers=1, addr=("127.0.0.1", 1234), lo=0, hi=100, n_params=100, dtype="float32",
             world_size=2, transport="tcp", mode="bsp", nonce=rdv.new_nonce())
    d.update(kw)
    return rdv.ServerInfo(**d)


def _join_kw(**kw):
    d = dict(rank=0, addr=("127.0.0.1", 999), n_params=100, dtype="float32", world_size=2, transport="tcp",
             timeout_s=5)
    d.update(kw)
    return d


def _serve_until_verdict(srv, fn, round_=None):
    """Run the worker side in a thread while the PS polls (what the server loop does)."""
    import threading

    out = {}

    def run():
        try:
            out["ok"] = fn()
        except Exception as exc:  # noqa: BLE001 - handed to the test
            out["err"] = exc

    t = threading.Thread(target=run)
    t.start()
    acc, rej = [], []
    while t.is_alive():
        a, r = srv.poll(round_)
        acc += a
        rej += r
        t.join(0.02)
    a, r = srv.poll(round_)
    return out, acc + a, rej + r


def test_join_accepted_and_published_info_verified(stores):
    ps_store, w_store = stores
    srv = rdv.ServerRendezvous(ps_store, b"s3cret", _info())
    info = rdv.fetch_server(w_store, b"s3cret", 0, timeout_s=5)
    assert info.addr == ("127.0.0.1", 1234) and info.n_params == 100
    out, acc, rej = _serve_until_verdict(srv, lambda: rdv.join(w_store, b"s3cret", info, **_join_kw(rank=1)))
    assert "err" not in out and rej == []
    assert [a["rank"] for a in acc] == [1] and tuple(acc[0]["addr"]) == ("127.0.0.1", 999)


def test_a_worker_learns_the_round_it_was_admitted_at(stores):
    """A round-program worker that joins (again) mid-job starts at the PS's round, not at round 0 of rounds long
    over (a RAT worker that rejoined used to walk rounds 0..R, each waiting for parameters that never came)."""
    ps_store, w_store = stores
    srv = rdv.ServerRendezvous(ps_store, b"s3cret", _info())
    info = rdv.fetch_server(w_store, b"s3cret", 0, timeout_s=5)
    out, acc, _ = _serve_until_verdict(srv, lambda: rdv.join(w_store, b"s3cret", info, **_join_kw(rank=1)),
                                       round_=37)
    assert rdv.admitted_round(w_store, 0, out["ok"]) == 37 == rdv.admitted_round(w_store, 0, acc[0]["ticket"])
    out, _, _ = _serve_until_verdict(srv, lambda: rdv.join(w_store, b"s3cret", info, **_join_kw(rank=1)))
    assert rdv.admitted_round(w_store, 0, out["ok"]) is None  # a PS that did not say: the worker starts at 0
    out, _, rej = _serve_until_verdict(srv, lambda: rdv.join(w_store, b"s3cret", info, **_join_kw(rank=1, n_params=5)),
                                       round_=40)
    assert rej and isinstance(out["err"], MembershipError)
    assert rdv.admitted_round(w_store, 0, acc[0]["ticket"] + 2) is None  # refused: no round is published


def test_worker_with_wrong_secret_fails_before_writing(stores):
    ps_store, w_store = stores
    rdv.ServerRendezvous(ps_store, b"right", _info())
    with pytest.raises(AuthError, match="LTP_PS_SECRET"):
        rdv.fetch_server(w_store, b"wrong", 0, timeout_s=5)
    assert int(w_store.add("joins/0", 0)) == 0  # nothing was written


def test_ps_rejects_forged_request(stores):
    ps_store, w_store = stores
    srv = rdv.ServerRendezvous(ps_store, b"right", _info())
    info = rdv.fetch_server(w_store, b"right", 0, timeout_s=5)
    # an attacker who read the store but lacks the secret signs with another key
    out, acc, rej = _serve_until_verdict(srv, lambda: rdv.join(w_store, b"guess", info, **_join_kw()))
    assert isinstance(out["err"], AuthError) and acc == []
    assert "authentication failed" in rej[0][1]


@pytest.mark.parametrize("field,value,match", [
    ("n_params", 99, "model size mismatch"),
    ("dtype", "float16", "dtype mismatch"),
    ("world_size", 3, "world size mismatch"),
    ("rank", 2, "out of range"),
    ("transport", "ltp", "transport mismatch"),
])
def test_ps_rejects_misconfigured_worker_with_clear_reason(stores, field, value, match):
    ps_store, w_store = stores
    srv = rdv.ServerRendezvous(ps_store, b"k", _info())
    info = rdv.fetch_server(w_store, b"k", 0, timeout_s=5)
    out, acc, rej = _serve_until_verdict(srv, lambda: rdv.join(w_store, b"k", info, **_join_kw(**{field: value})))
    assert isinstance(out["err"], MembershipError) and match in str(out["err"])
    assert acc == [] and match in rej[0][1]
    # a correct worker still gets in afterwards: the job is not corrupted
    out, acc, rej = _serve_until_verdict(srv, lambda: rdv.join(w_store, b"k", info, **_join_kw()))
    assert "err" not in out and len(acc) == 1


def test_restarted_server_ignores_old_tickets(stores):
    ps_store, w_store = stores
    srv = rdv.ServerRendezvous(ps_store, b"k", _info())
    info = rdv.fetch_server(w_store, b"k", 0, timeout_s=5)
    _serve_until_verdict(srv, lambda: rdv.join(w_store, b"k", info, **_join_kw()))
    srv2 = rdv.ServerRendezvous(ps_store, b"k", _info())
    assert srv2.poll() == ([], [])
    info2 = rdv.fetch_server(w_store, b"k", 0, timeout_s=5)
    assert info2.nonce != info.nonce
    out, acc, _ = _serve_until_verdict(srv2, lambda: rdv.join(w_store, b"k", info2, **_join_kw(rank=1)))
    assert [a["rank"] for a in acc] == [1]


def test_missing_server_and_store_errors_are_clear(stores, monkeypatch, tmp_path):
    _, w_store = stores
    with pytest.raises(RendezvousError, match="did not publish"):
        rdv.fetch_server(w_store, b"k", 0, timeout_s=0.2)
    with pytest.raises(RendezvousError, match="MASTER_ADDR"):
        rdv.make_store("127.0.0.1", _port(), is_master=False, timeout_s=0.5)
    monkeypatch.delenv("LTP_PS_SECRET", raising=False)
    with pytest.raises(ConfigError, match="LTP_PS_SECRET"):
        rdv.load_secret(None)
    f = tmp_path / "secret"
    f.write_text("abc\n")
    assert rdv.load_secret(str(f)) == b"abc"
    monkeypatch.setenv("LTP_PS_SECRET", "xyz")
    assert rdv.load_secret(None) == b"xyz"
    info = json.loads(json.dumps(_info().to_dict()))
    assert rdv.ServerInfo.from_dict(info).addr == ("127.0.0.1", 1234)
