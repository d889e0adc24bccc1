"""The exceptions the compiled modules and their twins raise, in one pure-Python module.

Both ``ltp_ext._<name>`` and ``ltp_ext._<name>_py`` import them from here, so a
caller catches the same class whichever implementation is loaded. ``ltp_ext``
imports nothing from ``ltp`` (the transport is built on top of it, not the
other way round): :mod:`ltp.errors` re-exports these classes and adds the
transfer-level errors, so ``ltp.errors.WireError is ltp_ext.errors.WireError``.
"""

from __future__ import annotations

__all__ = ["LTPError", "LocalProtocolError", "RemoteProtocolError", "WireError"]


class LTPError(Exception):
    """Base class of every LTP error."""


class LocalProtocolError(LTPError, ValueError):
    """The caller misused the API; the message names the fix."""


class RemoteProtocolError(LTPError):
    """The peer violated the protocol."""


class WireError(RemoteProtocolError, ValueError):
    """A datagram could not be decoded. ``reason`` is the drop-counter key."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
