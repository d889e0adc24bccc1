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

The reliable parameter broadcast (PS -> ``n`` workers, ``B`` bytes each) is
bounded the same way, without the compute term (the workers only receive)::

    broadcast = max(BROADCAST_FLOOR_S,
                    GATHER_BASE_S + TRANSFER_MARGIN * (n * B / rate + RTT_MULTIPLE * rtprop))

from the same rate samples.  The floor keeps a small model's broadcast from
being cut on a CPU-starved host (a failed broadcast drops that worker, so a
false timeout costs a live worker); a large model on a slow link gets what its
size needs (ResNet-50 size to 6 workers before any sample: ~200 s, where a
fixed 30 s cut it).  ``ServerConfig.broadcast_timeout_s`` fixes it.
The object takes samples and returns numbers; it never reads a clock.
"""

from __future__ import annotations

import collections
import dataclasses

from .errors import ConfigError

GATHER_BASE_S = 2.0  # seconds: scheduling noise on a loaded host (GC, thread hand-offs)
COMPUTE_MARGIN = 2.0  # x the slowest reported compute time
TRANSFER_MARGIN = 4.0  # x the transfer time at the lowest measured rate
RTT_MULTIPLE = 4.0  # round trips of handshakes/loss recovery per transfer
INITIAL_COMPUTE_S = 10.0  # seconds allowed for a first step before any compute time is known
FLOOR_RATE_BPS = 100e6  # bit/s assumed before anything was measured (conservative)
RATE_WINDOW = 8  # samples (rounds) remembered
BROADCAST_FLOOR_S = 10.0  # seconds: the least a reliable parameter broadcast is given


@dataclasses.dataclass
class GatherDeadline:
    """Per-round gather and broadcast bounds; ``fixed_s`` (``--gather-timeout``) and
    ``broadcast_fixed_s`` override the derived rules."""

    fixed_s: float | None = None
    window: int = RATE_WINDOW
    broadcast_fixed_s: float | None = None

    def __post_init__(self):
        if self.fixed_s is not None and not self.fixed_s > 0:
            raise ConfigError(f"gather timeout must be > 0 seconds, got {self.fixed_s}; "
                             f"omit --gather-timeout to derive it from the measured link rate")
        if self.broadcast_fixed_s is not None and not self.broadcast_fixed_s > 0:
            raise ConfigError(f"broadcast timeout must be > 0 seconds, got {self.broadcast_fixed_s}; omit "
                              f"--broadcast-timeout (broadcast_timeout_s at None) to derive it from the measured "
                              f"link rate")
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

    def broadcast_timeout(self, message_bytes: int, n_peers: int) -> float:
        """Seconds a reliable broadcast of ``message_bytes`` to each of ``n_peers`` may take."""
        if self.broadcast_fixed_s is not None:
            return self.broadcast_fixed_s
        rtprop = max(self._rtprop) if self._rtprop else 0.0
        transfer = max(1, n_peers) * message_bytes / self.rate_bytes_per_s + RTT_MULTIPLE * rtprop
        return max(BROADCAST_FLOOR_S, GATHER_BASE_S + TRANSFER_MARGIN * transfer)

    def explain(self, message_bytes: int, n_peers: int) -> str:
        """One line for logs: the bound and what it came from."""
        if self.fixed_s is not None:
            return f"gather timeout {self.fixed_s:.2f} s (fixed by --gather-timeout)"
        return (f"gather timeout {self.timeout(message_bytes, n_peers):.2f} s = {GATHER_BASE_S:g} s + "
                f"{COMPUTE_MARGIN:g} x compute + {TRANSFER_MARGIN:g} x ({n_peers} x {message_bytes} B at "
                f"{self.rate_bytes_per_s * 8 / 1e6:.1f} Mbit/s"
                f"{' measured' if self._rates else ' assumed (nothing measured yet)'})")
