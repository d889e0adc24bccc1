"""Membership and rendezvous through torch's TCPStore (no home-made launcher protocol).

Store layout (all keys under the prefix ``ltp_ps/<job>/``)::

    server/<s>          JSON ServerInfo of PS shard s, with an HMAC ``proof``
    joins/<s>           counter; a worker takes a ticket with ``add(joins/<s>, 1)``
    join/<s>/<ticket>   JSON JoinRequest (rank, address, model size/dtype, world size, ``mac``)
    verdict/<s>/<t>     "ok" or "rejected: <reason>" written by the shard
    done/<s>            set when shard s finished training
    failed/<s>          the reason, when shard s stopped with an error (cleared by a restart)

Restarts: the store must outlive a PS (``ltp-ps launch`` hosts it in its own
``ltp-ps store`` process; torchrun's agent hosts it under torchrun).  A
restarted shard publishes a fresh ``nonce`` (a new *incarnation*) and ignores
tickets taken before it started; workers notice the new nonce, and a join
that was waiting on the old incarnation fails with :class:`StaleIncarnation`
so the worker joins the new one.

Authentication: the PS publishes a fresh random ``nonce`` and
``proof = HMAC(secret, "server" | info)``; a worker with another secret fails
to verify the proof and stops with :class:`AuthError` *before* writing
anything.  The worker's request carries ``mac = HMAC(secret, "worker" | nonce |
request)``; the PS admits only requests whose mac verifies and whose model
size, dtype and world size match, and answers every request with a verdict,
so a misconfigured worker gets a clear error and never enters the gather.

Roles come from torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) or the CLI; ranks ``< num_servers`` are PS shards.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import hmac
import json
import os
import secrets
import time

from .errors import AuthError, ConfigError, JobEnded, MembershipError, RendezvousError, StaleIncarnation

DEFAULT_SECRET_ENV = "LTP_PS_SECRET"
INCARNATION_POLL_S = 0.5  # seconds between looks at server/<s> while a join waits for its verdict


def load_secret(secret_file: str | None = None, env: str = DEFAULT_SECRET_ENV) -> bytes:
    """The job secret from ``--secret-file`` or ``$LTP_PS_SECRET``."""
    if secret_file:
        with open(secret_file, "rb") as f:
            data = f.read().strip()
        if not data:
            raise ConfigError(f"secret file {secret_file} is empty")
        return data
    val = os.environ.get(env)
    if val:
        return val.encode()
    raise ConfigError(f"no job secret: set {env}=<random string> for every process or pass --secret-file "
                      f"(e.g. `export {env}=$(openssl rand -hex 16)`)")


def _mac(secret: bytes, *parts: bytes) -> str:
    return hmac.new(secret, b"|".join(parts), hashlib.sha256).hexdigest()


def _canon(d: dict) -> bytes:
    return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()


def make_store(host: str, port: int, *, is_master: bool, timeout_s: float = 60.0):
    """A TCPStore client (or server when ``is_master``)."""
    from torch.distributed import TCPStore

    try:
        return TCPStore(host, int(port), None, is_master, datetime.timedelta(seconds=timeout_s),
                        wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        role = "host" if is_master else "reach"
        raise RendezvousError(f"cannot {role} the rendezvous store at {host}:{port} ({exc}); check "
                              f"MASTER_ADDR/MASTER_PORT (or --store) and that the PS is running") from exc


def prefixed(store, job: str):
    from torch.distributed import PrefixStore

    return PrefixStore(f"ltp_ps/{job}/", store)


def store_from_env(timeout_s: float = 60.0):
    """torchrun-style: MASTER_ADDR/MASTER_PORT; rank 0 hosts it unless torchrun's agent does."""
    try:
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except KeyError as exc:
        raise ConfigError(f"{exc.args[0]} is not set; run under torchrun or pass --store HOST:PORT") from None
    rank = int(os.environ.get("RANK", "0"))
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return make_store(host, port, is_master=(rank == 0 and not agent), timeout_s=timeout_s)


@dataclasses.dataclass(frozen=True)
class ServerInfo:
    shard: int
    num_servers: int
    addr: tuple
    lo: int
    hi: int
    n_params: int
    dtype: str
    world_size: int  # number of workers the job expects
    transport: str
    mode: str  # "bsp" | "async"
    nonce: str

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["addr"] = list(self.addr)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ServerInfo":
        d = dict(d)
        d["addr"] = tuple(d["addr"])
        return cls(**d)


class ServerRendezvous:
    """The PS shard's side: publish, then admit joins as they come (poll from the loop)."""

    def __init__(self, store, secret: bytes, info: ServerInfo):
        self.store = store
        self.secret = secret
        self.info = info
        self._next_ticket = 1
        d = info.to_dict()
        d["proof"] = _mac(secret, b"server", _canon(info.to_dict()))
        # Restart of a shard: tickets taken before belong to the old incarnation.
        self._next_ticket = int(store.add(f"joins/{info.shard}", 0)) + 1
        if store.check([f"failed/{info.shard}"]):
            store.delete_key(f"failed/{info.shard}")
        store.set(f"server/{info.shard}", json.dumps(d))

    def mark_dropped(self, rank: int) -> None:
        """Tell worker ``rank`` (``dropped/<s>/<rank>``, a count) that this shard dropped it: a worker that was
        stopped or cut off learns it at once and rejoins, instead of waiting out its ``--pull-timeout``."""
        self.store.add(f"dropped/{self.info.shard}/{rank}", 1)

    def mark_failed(self, reason: str) -> None:
        """Tell the workers (``failed/<s>``) that this shard stopped the job with an error."""
        self.store.set(f"failed/{self.info.shard}", reason)

    def poll(self, round_: int | None = None) -> tuple[list[dict], list[tuple[int, str]]]:
        """New join requests: (accepted requests, [(rank, reason)] rejected).

        ``round_``: the round the PS is at; an accepted worker reads it (:func:`admitted_round`) and starts
        there, rather than at round 0 of a job far past it."""
        s = self.info.shard
        last = int(self.store.add(f"joins/{s}", 0))
        accepted, rejected = [], []
        while self._next_ticket <= last:
            t = self._next_ticket
            key = f"join/{s}/{t}"
            if not self.store.check([key]):
                break  # ticket taken, request not written yet: look again next poll
            self._next_ticket += 1
            req = json.loads(self.store.get(key))
            reason = self.check(req)
            if reason is None and round_ is not None:
                self.store.set(f"admitted/{s}/{t}", str(int(round_)))  # before the verdict the worker waits for
            self.store.set(f"verdict/{s}/{t}", "ok" if reason is None else f"rejected: {reason}")
            if reason is None:
                accepted.append({**req, "ticket": t})
            else:
                rejected.append((req.get("rank", -1), reason))
        return accepted, rejected

    def check(self, req: dict) -> str | None:
        mac = req.pop("mac", "")
        want = _mac(self.secret, b"worker", self.info.nonce.encode(), _canon(req))
        if not hmac.compare_digest(mac, want):
            return ("authentication failed: the job secret differs from the PS's "
                    "(set the same LTP_PS_SECRET / --secret-file on every process)")
        i = self.info
        if req.get("n_params") != i.n_params:
            return (f"model size mismatch: worker has {req.get('n_params')} parameters, PS has {i.n_params} "
                    f"(use the same --model on every process)")
        if req.get("dtype") != i.dtype:
            return f"dtype mismatch: worker {req.get('dtype')}, PS {i.dtype}"
        if req.get("world_size") != i.world_size:
            return (f"world size mismatch: worker expects {req.get('world_size')} workers, PS {i.world_size} "
                    f"(use the same --workers / WORLD_SIZE everywhere)")
        if not 0 <= int(req.get("rank", -1)) < i.world_size:
            return f"worker rank {req.get('rank')} out of range 0..{i.world_size - 1}"
        if req.get("transport") != i.transport:
            return f"transport mismatch: worker {req.get('transport')}, PS {i.transport} (same --transport everywhere)"
        return None


def fetch_server(store, secret: bytes, shard: int, *, timeout_s: float = 60.0) -> ServerInfo:
    """Wait for shard ``shard`` to publish itself and verify it knows the secret."""
    key = f"server/{shard}"
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise RendezvousError(f"PS shard {shard} did not publish itself within {timeout_s:.0f} s; "
                                  f"is `ltp-ps server` running with the same --store/--job?")
        time.sleep(0.05)
    d = json.loads(store.get(key))
    proof = d.pop("proof", "")
    if not hmac.compare_digest(proof, _mac(secret, b"server", _canon(d))):
        raise AuthError("authentication failed: this worker's job secret differs from the PS's "
                        "(set the same LTP_PS_SECRET or --secret-file on every process)")
    return ServerInfo.from_dict(d)


def join(store, secret: bytes, info: ServerInfo, *, rank: int, addr: tuple, n_params: int, dtype: str,
         world_size: int, transport: str, timeout_s: float = 60.0) -> int:
    """Ask shard ``info.shard`` to admit this worker; raise MembershipError if refused.

    Returns the request's ticket (unique per join of the shard): the PS learns it with the request, so both ends
    can keep this incarnation's control streams apart from an earlier one's (``ControlChannel(epoch=)``)."""
    req = {"rank": rank, "addr": list(addr), "n_params": n_params, "dtype": dtype,
           "world_size": world_size, "transport": transport, "pid": os.getpid(),
           "salt": secrets.token_hex(8)}
    req["mac"] = _mac(secret, b"worker", info.nonce.encode(), _canon(req))
    s = info.shard
    t = int(store.add(f"joins/{s}", 1))
    store.set(f"join/{s}/{t}", json.dumps(req))
    key = f"verdict/{s}/{t}"
    t0 = time.monotonic()
    next_look = t0 + INCARNATION_POLL_S
    while not store.check([key]):
        now = time.monotonic()
        if now > t0 + timeout_s:
            raise RendezvousError(f"PS shard {s} did not answer the join request within {now - t0:.0f} s; "
                                  f"is it running (a crashed PS must be restarted)?")
        if now >= next_look:
            next_look = now + INCARNATION_POLL_S
            if current_nonce(store, s) != info.nonce:
                raise StaleIncarnation(f"PS shard {s} restarted while worker {rank}'s join was pending")
            if job_over(store, info.num_servers):
                raise JobEnded(f"the job ended while worker {rank}'s join to PS shard {s} was pending")
        time.sleep(0.02)
    verdict = store.get(key).decode()
    if verdict != "ok":
        reason = verdict.removeprefix("rejected: ")
        if reason.startswith("authentication"):
            raise AuthError(f"PS shard {s} refused worker {rank}: {reason}")
        raise MembershipError(f"PS shard {s} refused worker {rank}: {reason}")
    return t


def admitted_round(store, shard: int, ticket: int) -> int | None:
    """The round PS shard ``shard`` was at when it accepted join ``ticket`` (:meth:`ServerRendezvous.poll`),
    or None if it did not say."""
    key = f"admitted/{shard}/{ticket}"
    if not store.check([key]):
        return None
    return int(store.get(key).decode())


def current_nonce(store, shard: int) -> str | None:
    """The nonce shard ``shard`` published last (its incarnation), or None if it never did."""
    key = f"server/{shard}"
    if not store.check([key]):
        return None
    return json.loads(store.get(key)).get("nonce")


def wait_new_incarnation(store, infos, poll_s: float, timeout_s: float) -> bool:
    """True once any shard in ``infos`` published another nonce; False after ``timeout_s`` (0: look once)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if any(current_nonce(store, i.shard) not in (None, i.nonce) for i in infos):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


def drop_count(store, shard: int, rank: int) -> int:
    """How many times shard ``shard`` has dropped worker ``rank`` (:meth:`ServerRendezvous.mark_dropped`)."""
    return int(store.add(f"dropped/{shard}/{rank}", 0))


def job_over(store, num_servers: int = 1) -> bool:
    """True when shard 0 finished or any shard stopped with an error (nothing left to rejoin)."""
    return bool(store.check(["done/0"])) or any(store.check([f"failed/{s}"]) for s in range(num_servers))


def new_nonce() -> str:
    return secrets.token_hex(16)
