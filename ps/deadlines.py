"""How long a PS round may wait for the workers' gradients, from size and measured rates (sans-IO).

Theory of operation
-------------------
A BSP gather waits for the workers' compute *and* for ``n`` gradients of ``B``
bytes each to cross the PS's link.  A fixed bound is wrong both ways: 10 s cut
every round of a 102 MB model on a CPU-starved host (all workers dropped, NaN
loss), and it lets a dead worker stall a 150 kB job for 10 s.  The default bound
is therefore derived each round::

    timeout = GATHER_BASE_S + COMPUTE_MARGIN * compute_s
              + TRANSFER_MARGIN * (n * B / rate + RTT_MULTIPLE * rtprop)

* ``rate`` (bytes/s) is the *lowest* of the last ``RATE_WINDOW`` rate samples
  at this PS: the goodput of each reliable broadcast (n x message bytes over
  its duration), the goodput of each complete gather (bytes received over the
  transfer part of the wait) and, where the transport reports them, LTP's
  per-path BtlBw estimates summed over the peers.  The lowest sample is the
  conservative choice: a CPU-starved round is the one the next round must
  survive.  Before any sample exists ``rate`` is ``FLOOR_RATE_BPS``/8, a
  deliberately low 100 Mbit/s, so the first round of a large model gets a long
  bound rather than a false eviction.
* ``compute_s`` is the largest per-step compute time the workers reported in
  their gradient headers over the window; ``INITIAL_COMPUTE_S`` before any.
* ``rtprop`` is the largest RTprop the transport reported (0 for TCP).

``--gather-timeout S`` replaces the rule with a fixed ``S`` seconds.
The object takes samples and returns numbers; it never reads a clock.
"""

from __future__ import annotations

import collections
import dataclasses

GATHER_BASE_S = 2.0  # seconds: scheduling noise on a loaded host (GC, thread hand-offs)
COMPUTE_MARGIN = 2.0  # x the slowest reported compute time
TRANSFER_MARGIN = 4.0  # x the transfer time at the lowest measured rate
RTT_MULTIPLE = 4.0  # round trips of handshakes/loss recovery per transfer
INITIAL_COMPUTE_S = 10.0  # seconds allowed for a first step before any compute time is known
FLOOR_RATE_BPS = 100e6  # bit/s assumed before anything was measured (conservative)
RATE_WINDOW = 8  # samples (rounds) remembered


@dataclasses.dataclass
class GatherDeadline:
    """Per-round gather bound; ``fixed_s`` (``--gather-timeout``) overrides the derived rule."""

    fixed_s: float | None = None
    window: int = RATE_WINDOW

    def __post_init__(self):
        if self.fixed_s is not None and not self.fixed_s > 0:
            raise ValueError(f"gather timeout must be > 0 seconds, got {self.fixed_s}; "
                             f"omit --gather-timeout to derive it from the measured link rate")
        self._rates: collections.deque = collections.deque(maxlen=self.window)  # bytes/s
        self._compute: collections.deque = collections.deque(maxlen=self.window)  # seconds
        self._rtprop: collections.deque = collections.deque(maxlen=self.window)  # seconds

    # -- samples ---------------------------------------------------------
    def observe_transfer(self, nbytes: float, seconds: float) -> None:
        """A completed transfer of ``nbytes`` (all peers together) that took ``seconds``."""
        if nbytes > 0 and seconds > 0:
            self._rates.append(nbytes / seconds)

    def observe_rate(self, bytes_per_s: float) -> None:
        """A transport's own estimate of the PS link rate (e.g. summed LTP BtlBw), bytes/s."""
        if bytes_per_s > 0:
            self._rates.append(bytes_per_s)

    def observe_compute(self, seconds: float) -> None:
        if seconds >= 0:
            self._compute.append(seconds)

    def observe_rtprop(self, seconds: float) -> None:
        if seconds > 0:
            self._rtprop.append(seconds)

    # -- answers ---------------------------------------------------------
    @property
    def rate_bytes_per_s(self) -> float:
        """The conservative rate the rule uses: lowest recent sample, or the floor before any."""
        return min(self._rates) if self._rates else FLOOR_RATE_BPS / 8

    def timeout(self, message_bytes: int, n_peers: int) -> float:
        """Seconds the gather of ``n_peers`` messages of ``message_bytes`` may take."""
        if self.fixed_s is not None:
            return self.fixed_s
        compute = max(self._compute) if self._compute else INITIAL_COMPUTE_S
        rtprop = max(self._rtprop) if self._rtprop else 0.0
        transfer = max(1, n_peers) * message_bytes / self.rate_bytes_per_s + RTT_MULTIPLE * rtprop
        return GATHER_BASE_S + COMPUTE_MARGIN * compute + TRANSFER_MARGIN * transfer

    def explain(self, message_bytes: int, n_peers: int) -> str:
        """One line for logs: the bound and what it came from."""
        if self.fixed_s is not None:
            return f"gather timeout {self.fixed_s:.2f} s (fixed by --gather-timeout)"
        return (f"gather timeout {self.timeout(message_bytes, n_peers):.2f} s = {GATHER_BASE_S:g} s + "
                f"{COMPUTE_MARGIN:g} x compute + {TRANSFER_MARGIN:g} x ({n_peers} x {message_bytes} B at "
                f"{self.rate_bytes_per_s * 8 / 1e6:.1f} Mbit/s"
                f"{' measured' if self._rates else ' assumed (nothing measured yet)'})")
