"""How a transfer ended, named once: receive regimes and send close reasons.

Theory of operation. Every receive ends in exactly one :class:`Regime` (the
``regime`` of a :class:`~ltp.reports.RecvReport`) and every send that did not
fail ends with one :class:`CloseReason` (the ``close_reason`` of a
:class:`~ltp.reports.SendReport`): ``acked`` when every segment was
acknowledged, else the receiver's STOP reason. Both are ``str`` enums: a member
*is* its string (``Regime.COMPLETE == "complete"``, ``str()``, ``format()``
and ``json.dumps`` give the bare value), so reports, logs and JSON written
before the enum existed are unchanged and strings read back from them compare
equal to the members. The transport (``ltp``) and the parameter server
(``ltp_ps``, through ``ltp_ps.transport.base``) both use these members instead
of string literals.

The STOP codes on the wire (``ltp.wire.STOP_REASONS``) carry the receive
regimes a sender can be told about: ``complete``, ``early``, ``deadline`` and
``cancelled``. ``timeout`` never goes on the wire as such: a receive that
times out tells its sender ``deadline`` (:func:`stop_reason`).
"""

from __future__ import annotations

import enum

__all__ = ["Regime", "CloseReason", "stop_reason"]


class _StrEnum(str, enum.Enum):
    """A ``str`` enum whose ``str()``/``format()`` are its value (``enum.StrEnum`` is 3.11+)."""

    __str__ = str.__str__
    __format__ = str.__format__


class Regime(_StrEnum):
    """How a receive ended (``RecvReport.regime``)."""

    #: every segment arrived
    COMPLETE = "complete"
    #: Early Close cut the flow's long tail after its LT threshold (at least ``lt_fraction`` in)
    EARLY = "early"
    #: the receive group's Early Close deadline closed it with what had arrived
    DEADLINE = "deadline"
    #: the application (or the sender, by RESET) cancelled it
    CANCELLED = "cancelled"
    #: the caller's timeout, a silent sender (idle_timeout_s), an unreachable peer, or nothing registered
    #: before the group deadline
    TIMEOUT = "timeout"


class CloseReason(_StrEnum):
    """Why a send ended without an error (``SendReport.close_reason``)."""

    #: every segment was acknowledged
    ACKED = "acked"
    #: the receiver's STOP reasons (its :class:`Regime` as sent on the wire)
    COMPLETE = "complete"
    EARLY = "early"
    DEADLINE = "deadline"
    CANCELLED = "cancelled"


def stop_reason(regime: Regime) -> CloseReason:
    """The STOP reason a receiver sends for ``regime`` (``timeout`` goes out as ``deadline``)."""
    return CloseReason.DEADLINE if regime == Regime.TIMEOUT else CloseReason(regime)
