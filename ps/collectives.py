"""Collective algorithms as plain data: which element ranges go to whom, step by step.

Theory of operation
-------------------
A collective over ``world`` ranks works on one flat buffer per rank (the
*work buffer*).  An algorithm is a list of :class:`Step`; in a step a rank
sends some element ranges of its work buffer to some peers, receives element
ranges from other peers, and then *combines* what it received into its work
buffer, either by copying it in (``COPY``) or by folding it in with the
reduction operator (``REDUCE``).  Steps run one after another; the transfers
inside one step run in parallel.  Nothing here touches sockets, clocks or
tensors: the executor (:mod:`ltp_ps.backend`) moves the bytes.

Invariants every plan keeps (tested in ``tests/test_backend_plans.py``):

1. Matching: rank ``a`` sends range ``R`` to ``b`` in step ``s`` exactly when
   ``b`` receives range ``R`` from ``a`` in step ``s`` (so a step's tag names
   one message per ordered pair of ranks).
2. Single owner: every element of an all-reduce is reduced at exactly one rank
   and then copied everywhere else, so all ranks end with the *same bits*
   (replicas never drift apart, whatever the floating-point order).
3. Deterministic fold order: a ``REDUCE`` with several contributions folds
   them in rank order (own buffer included), so the result does not depend on
   arrival order.

Algorithms
----------
``direct`` (parameter-server style): every rank sends its buffer to the root
(rank 0), the root folds the ``world`` contributions in rank order and sends
the result back.  Two steps whatever the world size: best for small messages.

``ring``: reduce-scatter then all-gather around the ring ``r -> r+1``, each in
``world - 1`` steps over ``world`` chunks; every link carries
``2 (world-1)/world`` of the buffer, so it is the bandwidth-optimal choice for
large messages.  Rank ``r`` ends the reduce-scatter owning chunk ``r``.

:func:`default_algorithm` picks ``direct`` below :data:`RING_MIN_BYTES` or for
a single rank, ``ring`` otherwise.

Schedules
---------
A float32 sum/mean all-reduce can also run as a *schedule program* of
:mod:`ltp_ps.schedules` (the layer the PS-less trainers use), executed by
:class:`ltp_ps.schedules.executor.Executor`: ``ring`` (the rank-order ring of
:mod:`ltp_ps.schedules.ring`) or ``rsgcm`` (the RSGCM planner's ring set over
the ranks).  :func:`schedule_program` builds this rank's program as plain data;
``exact=True`` turns every loss-tolerant transfer into a reliable one (the
backend's collectives), ``exact=False`` keeps the schedule's own modes (the
DDP hook: a loss-tolerant reduce-scatter, a reliable all-gather).  Invariant 2
holds for the schedule programs too: each chunk is reduced by its owner and
copied to the others by a reliable all-gather.

:func:`default_schedule` is the rule for ``schedule="auto"``: ``direct`` for
one or two ranks (a two-rank ring moves the same bytes as the root does, in
as many steps) and for messages below :data:`RING_MIN_BYTES` (2 steps beat
``2 (world-1)``); ``ring`` otherwise.  ``rsgcm`` is never picked by default:
without a topology its search returns one ring through all ranks (in another
order), so it only pays where a topology is known.
"""

from __future__ import annotations

import dataclasses

REDUCE = "reduce"
COPY = "copy"
ALGORITHMS = ("direct", "ring")
#: reduction schedules (``direct`` runs the plans here; the others run as schedule programs)
SCHEDULES = ("direct", "ring", "rsgcm")
#: messages at least this large use the ring by default (below it, 2 steps beat 2(world-1) steps)
RING_MIN_BYTES = 256 * 1024  # bytes
#: the root of the direct algorithm
DIRECT_ROOT = 0


@dataclasses.dataclass(frozen=True)
class Transfer:
    """Elements ``[lo, hi)`` of the work buffer, to or from ``peer``."""

    peer: int
    lo: int
    hi: int


@dataclasses.dataclass(frozen=True)
class Step:
    """Parallel sends and receives, then one combine of what was received."""

    sends: tuple = ()
    recvs: tuple = ()
    combine: str = COPY


def chunk_bounds(n: int, parts: int) -> list[int]:
    """``parts + 1`` boundaries splitting ``n`` elements as evenly as possible (earlier chunks larger)."""
    if parts <= 0:
        raise ValueError("parts must be positive")
    q, rem = divmod(n, parts)
    out = [0]
    for i in range(parts):
        out.append(out[-1] + q + (1 if i < rem else 0))
    return out


def default_algorithm(world: int, nbytes: int) -> str:
    """``direct`` for one rank or small messages, ``ring`` for large ones."""
    return "ring" if world > 1 and nbytes >= RING_MIN_BYTES else "direct"


def default_schedule(world: int, nbytes: int) -> str:
    """The ``auto`` rule: ``direct`` for <= 2 ranks or below :data:`RING_MIN_BYTES`, ``ring`` otherwise."""
    return "ring" if world > 2 and nbytes >= RING_MIN_BYTES else "direct"


def schedule_program(schedule: str, rank: int, world: int, n: int, iteration: int, *, ring_plan=None,
                     exact: bool = True, critical=None):
    """This rank's :class:`~ltp_ps.schedules.program.Program` for a ``schedule`` all-reduce of ``n`` elements.

    ``schedule``: ``"ring"`` or ``"rsgcm"`` (``ring_plan``: the RSGCM
    :class:`~ltp_ps.schedules.rsgcm.RingPlan` every rank derived).  Ranks are
    the schedule's workers (node ``worker:<rank>``); tags carry
    ``iteration`` (at most :data:`ltp_ps.schedules.tags.MAX_ITERATION`).
    ``critical(lo, hi)``: element ranges of ``[lo, hi)`` a loss-tolerant send
    must deliver.  ``exact``: every transfer reliable.
    """
    from .schedules.program import worker
    from .schedules.ring import chunk_ranges, ring_programs

    _check(rank, world)
    crit = critical or (lambda lo, hi: ())
    if schedule == "ring":
        progs = ring_programs(list(range(world)), chunk_ranges(n, world), iteration, critical=crit)
    elif schedule == "rsgcm":
        from .schedules import rsgcm

        if ring_plan is None:
            raise ValueError("the rsgcm schedule needs the ring plan every rank derived (ring_plan=)")
        progs = rsgcm.programs(ring_plan, n, iteration=iteration, critical=crit).programs
    else:
        raise ValueError(f"unknown reduction schedule {schedule!r}; schedule programs exist for 'ring' and 'rsgcm' "
                         f"('direct' runs the plans of this module)")
    prog = progs[worker(rank)]
    return reliable_program(prog) if exact else prog


#: the model size (float32 elements) the RSGCM planner prices candidate rings with; on a uniform network the rings
#: it picks do not depend on it, and each call compiles the chosen plan for its own size
RSGCM_PLAN_ELEMS = 25_000_000
#: seed of the RSGCM search: every rank runs the same search and so derives the same plan
RSGCM_SEED = 0


def rsgcm_ring_plan(world: int):
    """The RSGCM ring plan over ranks ``0..world-1`` on a uniform network (deterministic: the same on every rank)."""
    import random

    from .schedules import rsgcm
    from .schedules.base import World

    sched = rsgcm.RsgcmSchedule(World(workers=tuple(range(world)), n_elems=RSGCM_PLAN_ELEMS),
                                rng=random.Random(RSGCM_SEED))
    return sched.current()


def reliable_program(program):
    """``program`` with every loss-tolerant Send/Recv/Forward made reliable (an exact collective)."""
    from .schedules.program import RELIABLE, Program

    def fix(step):
        if step.op in ("send", "recv", "forward") and step.mode != RELIABLE:
            return dataclasses.replace(step, mode=RELIABLE)
        return step

    return Program(program.node, tuple(tuple(fix(s) for s in st) for st in program.stages))


def _check(rank: int, world: int) -> None:
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} out of range for world size {world}")


def direct_allreduce(rank: int, world: int, n: int, root: int = DIRECT_ROOT) -> list[Step]:
    """Everyone -> root (fold in rank order), root -> everyone."""
    _check(rank, world)
    if world == 1 or n == 0:
        return []
    others = [p for p in range(world) if p != root]
    if rank == root:
        return [Step(recvs=tuple(Transfer(p, 0, n) for p in others), combine=REDUCE),
                Step(sends=tuple(Transfer(p, 0, n) for p in others))]
    return [Step(sends=(Transfer(root, 0, n),)),
            Step(recvs=(Transfer(root, 0, n),), combine=COPY)]


def ring_reduce_scatter(rank: int, world: int, bounds: list[int]) -> list[Step]:
    """``world - 1`` steps after which rank ``r`` holds the fully reduced chunk ``r`` (``bounds`` per rank)."""
    _check(rank, world)
    if len(bounds) != world + 1:
        raise ValueError(f"need {world + 1} chunk bounds, got {len(bounds)}")
    right, left = (rank + 1) % world, (rank - 1) % world
    steps = []
    for s in range(world - 1):
        c_out, c_in = (rank - s - 1) % world, (rank - s - 2) % world
        steps.append(Step(sends=(Transfer(right, bounds[c_out], bounds[c_out + 1]),),
                          recvs=(Transfer(left, bounds[c_in], bounds[c_in + 1]),), combine=REDUCE))
    return steps


def ring_allgather(rank: int, world: int, bounds: list[int]) -> list[Step]:
    """``world - 1`` steps after which every rank holds every chunk (rank ``r`` starts with chunk ``r``)."""
    _check(rank, world)
    right, left = (rank + 1) % world, (rank - 1) % world
    steps = []
    for s in range(world - 1):
        c_out, c_in = (rank - s) % world, (rank - s - 1) % world
        steps.append(Step(sends=(Transfer(right, bounds[c_out], bounds[c_out + 1]),),
                          recvs=(Transfer(left, bounds[c_in], bounds[c_in + 1]),), combine=COPY))
    return steps


def ring_allreduce(rank: int, world: int, n: int) -> list[Step]:
    """Reduce-scatter then all-gather over ``world`` even chunks; empty chunks are skipped."""
    _check(rank, world)
    if world == 1 or n == 0:
        return []
    b = chunk_bounds(n, world)
    return [_drop_empty(s) for s in ring_reduce_scatter(rank, world, b) + ring_allgather(rank, world, b)]


def direct_reduce_scatter(rank: int, world: int, bounds: list[int]) -> list[Step]:
    """Everyone sends chunk ``p`` to rank ``p``; each rank folds the ``world`` copies of its chunk."""
    _check(rank, world)
    if world == 1:
        return []
    lo, hi = bounds[rank], bounds[rank + 1]
    return [_drop_empty(Step(sends=tuple(Transfer(p, bounds[p], bounds[p + 1]) for p in range(world) if p != rank),
                             recvs=tuple(Transfer(p, lo, hi) for p in range(world) if p != rank), combine=REDUCE))]


def direct_allgather(rank: int, world: int, bounds: list[int]) -> list[Step]:
    """Everyone sends its own chunk to everyone (one step)."""
    _check(rank, world)
    if world == 1:
        return []
    lo, hi = bounds[rank], bounds[rank + 1]
    return [_drop_empty(Step(sends=tuple(Transfer(p, lo, hi) for p in range(world) if p != rank),
                             recvs=tuple(Transfer(p, bounds[p], bounds[p + 1]) for p in range(world) if p != rank),
                             combine=COPY))]


def allreduce_plan(algorithm: str, rank: int, world: int, n: int) -> list[Step]:
    """The all-reduce steps of ``algorithm`` (``"direct"`` or ``"ring"``)."""
    if algorithm == "direct":
        return direct_allreduce(rank, world, n)
    if algorithm == "ring":
        return ring_allreduce(rank, world, n)
    raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; use one of {ALGORITHMS} or 'auto'")


def reduce_scatter_plan(algorithm: str, rank: int, world: int, bounds: list[int]) -> list[Step]:
    """Reduce-scatter of a buffer cut at ``bounds``: rank ``r`` ends owning reduced chunk ``r``."""
    if algorithm == "direct":
        return direct_reduce_scatter(rank, world, bounds)
    if algorithm == "ring":
        return [_drop_empty(s) for s in ring_reduce_scatter(rank, world, bounds)]
    raise ValueError(f"unknown reduce-scatter algorithm {algorithm!r}; use one of {ALGORITHMS} or 'auto'")


def allgather_plan(algorithm: str, rank: int, world: int, bounds: list[int]) -> list[Step]:
    """All-gather of chunks cut at ``bounds``: rank ``r`` starts with chunk ``r``."""
    if algorithm == "direct":
        return direct_allgather(rank, world, bounds)
    if algorithm == "ring":
        return [_drop_empty(s) for s in ring_allgather(rank, world, bounds)]
    raise ValueError(f"unknown all-gather algorithm {algorithm!r}; use one of {ALGORITHMS} or 'auto'")


def _drop_empty(step: Step) -> Step:
    return Step(tuple(t for t in step.sends if t.hi > t.lo), tuple(t for t in step.recvs if t.hi > t.lo),
                step.combine)
