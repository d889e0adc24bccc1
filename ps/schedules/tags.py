"""Structured message tags: ``(iteration, phase, step, chunk, kind)`` packed into one integer.

Every message between PS shards and workers carries one unsigned 64-bit tag
(LTP's registration field, the TCP frame header).  Schedules need more than
``iteration * 8 + kind``: a ring names its step and the chunk it carries, a
tree its level, a chain its hop.  This module is the only place that packs
and unpacks tags.

Layout (most significant first; 63 bits, so a tag is also a positive int64)::

    iteration : 28 bits   round (BSP) or model version (async)
    phase     :  3 bits   PHASE_* (push, reduce-scatter, all-gather, ...)
    step      : 12 bits   step / hop / level within the phase
    chunk     : 16 bits   chunk (block, slice) index
    kind      :  4 bits   message kind (``ltp_ps.wire.KIND_*``)

The iteration is the most significant field, so "every tag of rounds before
``i``" is exactly ``tag < round_floor(i)`` (what ``Transport.discard_before``
needs).
"""

from __future__ import annotations

import dataclasses

ITERATION_BITS = 28
PHASE_BITS = 3
STEP_BITS = 12
CHUNK_BITS = 16
KIND_BITS = 4

_KIND_SHIFT = 0
_CHUNK_SHIFT = KIND_BITS
_STEP_SHIFT = _CHUNK_SHIFT + CHUNK_BITS
_PHASE_SHIFT = _STEP_SHIFT + STEP_BITS
_ITERATION_SHIFT = _PHASE_SHIFT + PHASE_BITS
TAG_BITS = _ITERATION_SHIFT + ITERATION_BITS  # 63

MAX_ITERATION = (1 << ITERATION_BITS) - 1
MAX_PHASE = (1 << PHASE_BITS) - 1
MAX_STEP = (1 << STEP_BITS) - 1
MAX_CHUNK = (1 << CHUNK_BITS) - 1
MAX_KIND = (1 << KIND_BITS) - 1

# Phases of a round.
PHASE_PUSH = 0  # worker -> PS (direct, trees: towards the root)
PHASE_PULL = 1  # PS -> worker (parameters, broadcast trees)
PHASE_REDUCE_SCATTER = 2  # rings: partial sums travel around the ring
PHASE_ALL_GATHER = 3  # rings: reduced blocks travel around the ring
PHASE_CONTROL = 4  # grants, ready notes, directory queries
PHASE_NAMES = {PHASE_PUSH: "push", PHASE_PULL: "pull", PHASE_REDUCE_SCATTER: "reduce_scatter",
               PHASE_ALL_GATHER: "all_gather", PHASE_CONTROL: "control"}


@dataclasses.dataclass(frozen=True, order=True)
class Tag:
    """One unpacked tag.  ``Tag(...).pack()`` / ``Tag.unpack(int)`` round-trip exactly."""

    iteration: int
    phase: int = PHASE_PUSH
    step: int = 0
    chunk: int = 0
    kind: int = 0

    def __post_init__(self):
        for name, top in (("iteration", MAX_ITERATION), ("phase", MAX_PHASE), ("step", MAX_STEP),
                          ("chunk", MAX_CHUNK), ("kind", MAX_KIND)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= top:
                raise ValueError(f"tag field {name}={v!r} is outside 0..{top}; "
                                 f"use fewer chunks/steps or restart the iteration count")

    def pack(self) -> int:
        return ((self.iteration << _ITERATION_SHIFT) | (self.phase << _PHASE_SHIFT) | (self.step << _STEP_SHIFT)
                | (self.chunk << _CHUNK_SHIFT) | (self.kind << _KIND_SHIFT))

    @classmethod
    def unpack(cls, tag: int) -> "Tag":
        if not isinstance(tag, int) or not 0 <= tag < (1 << TAG_BITS):
            raise ValueError(f"tag {tag!r} is not a packed {TAG_BITS}-bit schedule tag")
        return cls(iteration=(tag >> _ITERATION_SHIFT) & MAX_ITERATION, phase=(tag >> _PHASE_SHIFT) & MAX_PHASE,
                   step=(tag >> _STEP_SHIFT) & MAX_STEP, chunk=(tag >> _CHUNK_SHIFT) & MAX_CHUNK,
                   kind=(tag >> _KIND_SHIFT) & MAX_KIND)

    def describe(self) -> dict:
        return {"iteration": self.iteration, "phase": PHASE_NAMES.get(self.phase, self.phase), "step": self.step,
                "chunk": self.chunk, "kind": self.kind}


def pack(iteration: int, phase: int = PHASE_PUSH, step: int = 0, chunk: int = 0, kind: int = 0) -> int:
    """The integer tag of ``(iteration, phase, step, chunk, kind)``."""
    return Tag(iteration, phase, step, chunk, kind).pack()


def unpack(tag: int) -> Tag:
    """The fields of a packed tag (raises ``ValueError`` for a tag no schedule made)."""
    return Tag.unpack(tag)


def round_floor(iteration: int) -> int:
    """The smallest tag of ``iteration``: every tag of earlier rounds is smaller."""
    return Tag(iteration).pack()
