"""Liveness: when a silent peer counts as dead, and what the resulting error says.

Theory of operation. Two rules end transfers whose peer went quiet, both
measured on the engine's clock from the last datagram heard:

* **dead peer** (sending side): a send fails with ``TransferTimeout`` once its
  peer has sent nothing — on any flow, so a flow queued behind another to the
  same peer is not declared dead — for :func:`silence_limit`:
  ``max(Config.peer_silence_min_s, PEER_SILENCE_RTTS × srtt)``, at most
  ``Config.idle_timeout_s``. 64 RTTs leave room for BBR's PROBE_RTT and
  pacing gaps on a WAN; the floor absorbs CPU starvation of a live peer. (An
  ICMP unreachable report ends the send sooner: ``Engine.peer_unreachable``.)
* **idle sender** (receiving side): a receive flow whose sender has sent
  nothing for ``idle_timeout_s`` closes with regime ``timeout``. The engine
  scans for such flows every ``IDLE_SCAN_FRACTION × idle_timeout_s``.
* **own stall**: both rules judge a peer by a silence this process measured
  while it ran. Any input (the timer, a datagram, a call) that comes more
  than :data:`OWN_STALL_S` after the deadline the timer was armed for means
  this process did not run (SIGSTOP, a suspended VM, an event loop blocked in
  one call): what the peer sent meanwhile may not have been read, and what we
  meant to send was not sent, so every peer's silence is counted afresh from
  that moment (``Engine._note_stall``). A send's REGs are due at once, so
  ``Engine.send`` is such a deadline even for an idle engine with no timer
  armed: a process stopped between a send and the loop turn that flushes it is
  seen. A genuinely dead
  peer is still declared dead one limit later: the timer that judges it runs
  on time. A send's caller timeout (``Endpoint``) follows the same rule with
  its own ticks, every ``CALLER_TICK_S``: a tick this late, or a stall the
  engine noticed within the window, gives the send its whole window again.
* **own pause** (receiving side): a shorter lateness of the same kind, over
  :data:`OWN_PAUSE_S` (a garbage collection, a checkpoint write or aggregation
  that held the loop), is this process's too. Its senders were waiting for our
  ACKs, so the Early Close clocks of every open receive move on by the pause
  (``FlowReceiver.pause``, ``Engine._note_stall``): a PS that paused 0.3 s in a
  gather cut every gradient at about 14 % before (the simulator), none now. A
  receive's caller timeout is not moved. On the sending side, an ACK read
  after a pause for a transmission sent before it gives no RTT or rate sample
  (``Path.on_ack``'s ``timing_floor``), and registration rounds go out at least
  :data:`REG_ROUNDS_PER_SILENCE` times within the dead-peer limit, so a peer
  that paused is not judged dead while the back-off waits.
* **own pause** (sending side): the dead-peer rule's clock (``silence_from`` of
  each path and open send) moves on by the pause too (:func:`pause_credit`): a
  sender starved of CPU, paused 0.5 s after each of three lost registration
  rounds, heard nothing for 1.5 s of which it ran for a few ms, and failed
  "registration unanswered" against a live receiver (the simulator). What it
  did not run for is not the peer's silence. The credit is bounded: at most
  :data:`PAUSE_CREDIT_LIMITS` dead-peer limits past the last datagram heard, so
  a dead peer is still declared dead within ``1 + PAUSE_CREDIT_LIMITS`` limits
  of wall-clock silence however often this process pauses (a stall over
  :data:`OWN_STALL_S` still restarts the count, as above).

Every error states the peer, the elapsed time, the limit and how far the
transfer got. Pure functions: the engine passes in what they need.
"""

from __future__ import annotations

from .early_close import STALL_MIN_S

__all__ = ["PEER_SILENCE_RTTS", "IDLE_SCAN_FRACTION", "OWN_STALL_S", "OWN_PAUSE_S", "silence_limit",
           "silence_message", "idle_cause", "next_idle_scan", "stalled", "paused", "REG_ROUNDS_PER_SILENCE",
           "reg_gap_max", "PAUSE_CREDIT_LIMITS", "pause_credit"]

#: dead-peer rule: a send fails after this many smoothed RTTs of silence (floored, see Config)
PEER_SILENCE_RTTS = 64
#: how often receive flows are scanned for the idle rule, as a fraction of idle_timeout_s
IDLE_SCAN_FRACTION = 0.25
#: own-stall rule: a timer that runs this many seconds after its deadline means this process did not run
OWN_STALL_S = 1.0


#: a registration is repeated at least this many times within the dead-peer limit: a receiver whose socket
#: dropped the first rounds (a process paused 0.3 s behind a full socket) is not judged dead while the back-off
#: waits 1 s for its next round
REG_ROUNDS_PER_SILENCE = 4


def reg_gap_max(config, srtt_s: float | None) -> float:
    """The longest wait between two registration rounds to a peer: its dead-peer limit / REG_ROUNDS_PER_SILENCE."""
    return silence_limit(config, srtt_s) / REG_ROUNDS_PER_SILENCE


#: own-pause rule: an input this many seconds after the engine's deadline means this process paused, and the Early
#: Close clocks of its open receives move on by the pause (above scheduling noise: Early Close's STALL_MIN_S, a
#: few time slices of a loaded host)
OWN_PAUSE_S = STALL_MIN_S


def paused(due: float | None, now: float) -> float:
    """How long this process paused (the own-pause rule): ``now - due`` when an input at ``now`` comes over
    :data:`OWN_PAUSE_S` after the deadline ``due`` the engine's timer was armed for, else 0."""
    if due is None:
        return 0.0
    late = now - due
    return late if late > OWN_PAUSE_S else 0.0


#: own-pause rule, sending side: the dead-peer clock moves on by this process's pauses up to this many dead-peer
#: limits past the last datagram heard (so a dead peer is declared within 1 + this many limits of silence)
PAUSE_CREDIT_LIMITS = 2


def pause_credit(silence_from: float, last_heard: float, pause: float, now: float, limit: float) -> float:
    """The dead-peer clock after this process paused ``pause`` seconds before ``now`` (the own-pause rule):
    ``silence_from`` (the clock, at or after ``last_heard``, the last datagram heard) moved on by the pause, to no
    later than ``now`` and no later than :data:`PAUSE_CREDIT_LIMITS` × ``limit`` past ``last_heard``; never back."""
    return max(silence_from, min(now, silence_from + pause, last_heard + PAUSE_CREDIT_LIMITS * limit))


def stalled(due: float | None, now: float) -> bool:
    """True if a timer armed for ``due`` that runs at ``now`` tells of a stall of this process (the own-stall rule)."""
    return due is not None and now - due > OWN_STALL_S


def next_idle_scan(config, now: float) -> float:
    """When the receive flows are next scanned for the idle rule, after a scan (or the first receive) at ``now``."""
    return now + config.idle_timeout_s * IDLE_SCAN_FRACTION


def silence_limit(config, srtt_s: float | None) -> float:
    """Seconds of silence after which a peer counts as dead, from its smoothed RTT (None: not measured)."""
    rtt = srtt_s if srtt_s is not None else 0.0
    return min(config.idle_timeout_s, max(config.peer_silence_min_s, PEER_SILENCE_RTTS * rtt))


def silence_message(config, *, peer, srtt_s: float | None, silent_s: float, limit_s: float, ran_s: float,
                    progress: str, paused_s: float = 0.0) -> str:
    """The ``TransferTimeout`` message of a send whose peer was silent for ``silent_s`` (>= ``limit_s``).

    ``ran_s``: how long the send ran; ``progress``: how far it got, in words; ``paused_s``: how much of the silence
    was this process's own pauses, not counted against the peer (:func:`pause_credit`)."""
    rtt = f"{srtt_s * 1e3:.2f} ms" if srtt_s is not None else "not measured"
    own = f" ({paused_s:.3f} s of it this process's own pauses, not counted)" if paused_s > 1e-3 else ""
    return (f"peer {peer} sent nothing for {silent_s:.3f} s{own}, the dead-peer limit "
            f"(max({config.peer_silence_min_s} s, {PEER_SILENCE_RTTS} x RTT {rtt}), at most idle_timeout_s="
            f"{config.idle_timeout_s} s, = {limit_s:.3f} s); the send ran {ran_s:.3f} s ({progress}). "
            "The peer process probably died or the path is down")


def idle_cause(peer, *, silent_s: float, idle_timeout_s: float, received: int, seg_count: int,
               ran_s: float) -> str:
    """The report cause of a receive closed because its sender was silent for ``silent_s``."""
    return (f"sender {peer} sent nothing for {silent_s:.3f} s (idle_timeout_s={idle_timeout_s} s); "
            f"{received}/{seg_count} segments had arrived in {ran_s:.3f} s")
