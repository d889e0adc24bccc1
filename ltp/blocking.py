"""A blocking, socket-like wrapper for synchronous training code.

:class:`Socket` runs an :class:`~ltp.endpoint.Endpoint` on a private event
loop in a daemon thread (uvloop when installed) and exposes the same calls as
blocking methods. Calls from several threads are safe: each is submitted to
the loop thread with ``run_coroutine_threadsafe``.
"""

from __future__ import annotations

import asyncio
import threading

from .config import Config
from .endpoint import check_linger, open_endpoint
from .errors import LocalProtocolError

__all__ = ["Socket"]


def _refuse_inside_loop(what: str) -> None:
    """A blocking call made from a thread that runs an event loop would stall that loop: refuse it."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise LocalProtocolError(
        f"ltp.Socket.{what} blocks, and it was called from inside a running asyncio event loop, which it would "
        f"stall; in async code use `ep = await ltp.open_endpoint(...)` and `await ep.{what.split('(')[0]}(...)`, "
        "or call the Socket from a worker thread (asyncio.to_thread)")


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class Socket:
    """Blocking LTP endpoint: ``send``, ``recv``, ``gather``, ``broadcast``, ``close``."""

    def __init__(self, local_addr=("0.0.0.0", 0), *, config: Config | None = None, rng=None, peer=None) -> None:
        _refuse_inside_loop("__init__()")
        self._loop = _new_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ltp-socket", daemon=True)
        self._thread.start()
        try:
            self._ep = self._call(open_endpoint(local_addr, config=config, rng=rng, peer=peer))
        except BaseException:
            self._stop_loop()
            raise
        self._closed = False

    def _call(self, coro, timeout=None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _check(self) -> None:
        if self._closed:
            raise LocalProtocolError("socket is closed; create a new ltp.Socket")

    @property
    def local_addr(self) -> tuple:
        """The bound ``(host, port)``."""
        return self._ep.local_addr

    @property
    def peer(self) -> tuple | None:
        """The one peer of a connected socket (``peer=``; :func:`ltp.open_endpoint`), or None."""
        return self._ep.peer

    @property
    def stats(self):
        """Endpoint counters (see :class:`~ltp.reports.EndpointStats`)."""
        return self._ep.stats

    def send(self, peer, data, **kw):
        """Blocking :meth:`Endpoint.send`."""
        _refuse_inside_loop("send()")
        self._check()
        return self._call(self._ep.send(peer, data, **kw))

    def recv(self, into, **kw):
        """Blocking :meth:`Endpoint.recv`."""
        _refuse_inside_loop("recv()")
        self._check()
        return self._call(self._ep.recv(into, **kw))

    def gather(self, peers, into, **kw):
        """Blocking :meth:`Endpoint.gather`."""
        _refuse_inside_loop("gather()")
        self._check()
        return self._call(self._ep.gather(peers, into, **kw))

    def broadcast(self, peers, data, **kw):
        """Blocking :meth:`Endpoint.broadcast`."""
        _refuse_inside_loop("broadcast()")
        self._check()
        return self._call(self._ep.broadcast(peers, data, **kw))

    def close(self, *, linger: float = 0.0) -> None:
        """Close the endpoint and stop the loop thread; ``linger`` as in :meth:`ltp.Endpoint.close` (the
        endpoint answers its peers for that many seconds first)."""
        if getattr(self, "_closed", True):
            return
        check_linger(linger)
        self._closed = True
        try:
            self._call(self._ep.close(linger=linger), timeout=10 + linger)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._loop.is_running():
            self._loop.close()

    def __enter__(self) -> "Socket":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass
