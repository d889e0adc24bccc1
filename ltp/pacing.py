"""User-space pacing: a token bucket refilled at the pacing rate.

Theory of operation. A user-space sender cannot wake up for every packet (at
10 Gbit/s a 1500-byte packet leaves every 1.2 µs); it wakes on a timer and
sends a *burst*. The bucket holds at most ``burst_bytes = max(min_burst,
rate × granularity)`` tokens, refills continuously at ``rate``, and a packet may
leave when a whole packet's worth of tokens is there. With the default 0.5 ms
granularity a 1 Gbit/s flow sends bursts of about 62.5 kB (≈ 43 packets) and a
10 Gbit/s flow about 625 kB; the burst never drops below ``min_burst`` (8
packets) so slow links still amortise the wake-up. The bucket is two bursts
deep: event-loop timers fire late (uvloop's have millisecond resolution), and
a late wake-up may then catch up instead of losing rate.

*Late wake-ups* (session 41). On a loaded host the loop runs its timers 1-3 ms
late, more than the second burst covers, and every such wake-up lost the rest:
granted senders (2-packet bursts, woken every few hundred µs of rate) reached
about three quarters of their grant. So a wake-up *after the time
:meth:`next_time` gave* (the flow was held by the pacer, not by its window or
by having nothing to send) also gets the tokens of its lateness, up to
:data:`LATE_CREDIT_BURSTS` bursts beyond the depth, for that wake-up only:
the next refill clips the bucket to its depth again. *Choice*: a deeper bucket
for everyone did the same for late wake-ups, but it also let a window-limited
flow bank four bursts and release them on the next ACK; in the simulator
(exact timers) 16 granted senders into a 32 kB queue then overflowed it. An
idle or window-limited stretch still banks two bursts at most. :meth:`next_time` tells the driver
when to wake up next; it never sleeps itself. This is finer than the paper's
"wait when more than 20 packets are queued" rule, which is the floor.
"""

from __future__ import annotations

__all__ = ["LATE_CREDIT_BURSTS", "Pacer"]

#: bursts of tokens a wake-up later than :meth:`Pacer.next_time`'s time may add beyond the bucket's depth
#: (its lateness x the rate, at most this): a timer up to this many granularities late, beyond the one the
#: depth covers, costs no rate. Side by side on a 2-core host (docs/performance.md, "Change 16"): ltp-bench
#: through a 1 Gbit/s tbf at 1 % loss 0.58, 0.67 Gbit/s without late credit and 0.91, 0.91 with it; 2 workers
#: into a 200 Mbit/s PS link 1.31, 1.10 s per gather without and 1.09, 1.05 s with (the grants' bound 1.04 s)
LATE_CREDIT_BURSTS = 2


class Pacer:
    """Token-bucket pacer (sans-IO: all methods take ``now``)."""

    def __init__(self, *, granularity_s: float, min_burst_bytes: int, rate: float) -> None:
        self.granularity_s = granularity_s
        self.min_burst_bytes = min_burst_bytes
        self.rate = float(rate)
        # a new path starts with one minimum burst, not a full bucket: N flows that start
        # together (the parameter server's incast) must not dump N full buckets at once
        self._tokens = float(min_burst_bytes)
        self._last = None  # type: float | None
        self._due = None  # type: float | None  # the time next_time last gave (the flow waits on the pacer)

    @property
    def burst_bytes(self) -> int:
        """Largest burst the bucket allows at the current rate."""
        return max(self.min_burst_bytes, int(self.rate * self.granularity_s))

    def set_rate(self, rate: float) -> None:
        """Change the pacing rate (bytes/s)."""
        self.rate = max(float(rate), 1.0)

    @property
    def depth_bytes(self) -> int:
        """Bucket depth: two bursts, so a timer that fires one granularity late costs no rate."""
        return 2 * self.burst_bytes

    def _refill(self, now: float) -> None:
        if self._last is not None and now > self._last:
            cap = float(self.depth_bytes)
            due = self._due
            if due is not None and now > due:  # a late wake-up: its lateness is not lost (see above)
                cap += min((now - due) * self.rate, float(LATE_CREDIT_BURSTS * self.burst_bytes))
            self._tokens = min(self._tokens + (now - self._last) * self.rate, cap)
        if self._due is not None and now >= self._due:
            self._due = None
        self._last = now if self._last is None or now > self._last else self._last

    def restart(self, now: float, phase: float = 1.0) -> None:
        """Hold at most ``phase`` (0..1) of one minimum burst from ``now``, whatever idle time saved up: a
        restart paced like a new pacer, its first burst ``(1 - phase)`` of a burst interval away."""
        self._refill(now)
        self._tokens = min(self._tokens, phase * self.min_burst_bytes)

    def available(self, now: float) -> int:
        """Bytes that may be sent at ``now``."""
        self._refill(now)
        return max(0, int(self._tokens))

    def consume(self, now: float, nbytes: int) -> None:
        """Account for ``nbytes`` just sent (the bucket may go briefly negative)."""
        self._refill(now)
        self._tokens -= nbytes

    def next_time(self, now: float, nbytes: int) -> float:
        """Earliest time at which ``nbytes`` may be sent."""
        self._refill(now)
        need = min(nbytes, self.burst_bytes) - self._tokens
        if need <= 0:
            return now
        # one byte of margin so float rounding can never wake us a hair too early
        self._due = now + (need + 1.0) / self.rate
        return self._due
