"""Exceptions of the parameter server, in one module.

Two families, as in h11: :class:`ConfigError` means *this* process was set up
wrongly (fix the command line or environment), :class:`RemoteError` means a
peer sent something we cannot accept.  Every message says how to fix it.
"""

from __future__ import annotations


class PSError(Exception):
    """Base of every error raised by ``ltp_ps``."""


class ConfigError(PSError, ValueError):
    """Local misuse: bad option, missing environment variable, bad model."""


class RemoteError(PSError):
    """A peer violated the protocol (bad header, wrong size, wrong version)."""


class RendezvousError(PSError):
    """Joining the job through the TCPStore failed."""


class AuthError(RendezvousError):
    """The job secret of this process and of the PS differ."""


class MembershipError(RendezvousError):
    """The PS rejected this worker (model size, dtype, world size, job full)."""


class StaleIncarnation(RendezvousError):
    """The PS restarted (published a new nonce) while this worker was joining the old one."""


class JobEnded(RendezvousError):
    """The job ended (shard 0 finished or a shard failed) while this worker was joining: nothing to join."""


class TransportError(PSError):
    """A transfer failed (peer gone, timeout, connection refused)."""


class PeerGone(TransportError, ConnectionError):
    """The peer is gone: unreachable (ICMP), or it closed or reset the connection.  Later transfers with it
    in the same round are pointless (``Executor`` excludes it)."""


class TransportTimeout(TransportError, TimeoutError):
    """A transfer did not finish within its timeout."""


class TrainingFailed(PSError):
    """The job cannot make progress: no live worker, no usable gradient, or a non-finite loss.

    Raised instead of printing a summary, so that a job that trained nothing never exits 0.
    """


class Excluded(TrainingFailed):
    """This worker was declared dead by the job while alive, after coming back ``tree_views.MAX_RETURNS`` times."""


class Stopped(PSError):
    """The PS told this worker that training is over."""
