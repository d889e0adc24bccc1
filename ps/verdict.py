"""Whether a finished run trained anything, judged from its per-epoch test accuracy (sans-IO).

Theory of operation
-------------------
A finite loss does not mean a job trained.  ``--lr 1e9`` with the norm guard
on keeps every value finite while the model sits at chance accuracy, and a
model that collapsed late (dead ReLUs after one oversized step, issue 7) also
ends at chance; without this rule both printed a summary and exited 0.  The PS
feeds every epoch's evaluation to :meth:`AccuracyVerdict.observe` and asks
:meth:`AccuracyVerdict.failure` once, after the last round and *before* it
sends STOP (so the workers read the failure too).  With ``level = chance +
CHANCE_MARGIN`` (chance: the accuracy of always answering the most common
test label, which the workload states as ``chance_accuracy``):

1. **collapsed** -- the best epoch reached ``chance + LEARNED_MARGIN`` (the
   model had clearly learned) but the last one is at or below ``level``: the
   job ends with a model no better than guessing.
2. **ends at chance** -- at least ``MIN_JUDGED_EPOCHS`` epochs were evaluated
   and the last one is at or below ``level``: "nothing trained" when no epoch
   ever rose above it, "fell back to chance" when one did (asynchronous SGD
   with momentum 0.9 on 4 workers: 0.19 at epoch 1, then 0.100 for four
   epochs, exit 0 before this rule).  A run of one or two epochs of a small
   model (or of a few ``--iterations``) may legitimately still be near chance,
   so such short runs are not judged.
3. **diverged** -- the last epoch is at or below ``level`` and its test loss
   is at least ``DIVERGED_LOSS_FACTOR`` times ``ln(round(1 / chance))`` (the
   cross-entropy of guessing uniformly among that many classes): judged after
   any number of epochs, since no slow start has such a loss (``--lr 1e6`` on
   digits for two epochs: loss 3e16, accuracy 0.10, exit 0 before this rule).

A run of two epochs that learned a little and ends near chance (best 0.17,
last 0.14 on digits: 6 asynchronous workers) is therefore not judged.  Nor
does rule 2 fire on a run that is *progressing*: its test loss
fell at every evaluated epoch, by at least ``PROGRESS_LOSS_DROP`` of its first
value in all, to below ``ln(round(1 / chance))`` (the cross-entropy of guessing
uniformly among that many classes), and its last accuracy is above its first (7 workers, lr 0.01,
momentum 0, 3 epochs: accuracy 0.106 -> 0.139 while the loss falls is a slow
start, not a failure).  An absurd learning rate under the norm guard also has a
falling test loss, but around 1e9, far above a uniform guess's; a collapse (rule 1) is judged on accuracy alone.

A run is not judged at all (``failure()`` is None) when the workload states no
chance level or reports no ``accuracy`` (synthetic parameter sets), or when no
epoch was evaluated (``evaluate=False``; a sharded run is evaluated by shard 0 on the model
assembled from every shard's slice, ``ltp_ps.sharded_eval``).  The object only takes
numbers and returns a message; it never reads a clock.
"""

from __future__ import annotations

import math

CHANCE_MARGIN = 0.05  # absolute accuracy: at most this far above chance counts as guessing
LEARNED_MARGIN = 0.25  # absolute accuracy: a best epoch this far above chance had clearly learned
MIN_JUDGED_EPOCHS = 3  # evaluated epochs before a run that never left chance is judged "trained nothing"
PROGRESS_LOSS_DROP = 0.02  # relative: a test loss falling every epoch, this much in all, is progress
DIVERGED_LOSS_FACTOR = 100.0  # a test loss this many times a uniform guess's, at chance accuracy: diverged


def _uniform_guess_loss(chance: float | None) -> float | None:
    """``ln(round(1 / chance))``, the cross-entropy of guessing uniformly among that many classes (at least 2),
    or None where ``chance`` states no usable class count (None, 0, or so small that 1 / chance overflows)."""
    if not chance:
        return None
    classes = 1.0 / chance
    return math.log(max(2, round(classes))) if math.isfinite(classes) else None


class AccuracyVerdict:
    """Collects ``(epoch, accuracy)`` and says whether the run failed to train."""

    def __init__(self, chance: float | None, *, margin: float = CHANCE_MARGIN, learned: float = LEARNED_MARGIN,
                 min_epochs: int = MIN_JUDGED_EPOCHS):
        if chance is not None and not 0.0 <= chance < 1.0:
            raise ValueError(f"chance accuracy must be in [0, 1), got {chance}; a workload that cannot state it "
                             f"sets chance_accuracy = None")
        if not 0 <= margin <= learned or min_epochs < 1:
            raise ValueError("need 0 <= margin <= learned and min_epochs >= 1")
        self.chance = chance
        self.margin = margin
        self.learned = learned
        self.min_epochs = min_epochs
        self.history: list[tuple[int, float]] = []  # (epoch, accuracy), in order observed
        self.losses: list[float] = []  # test loss per observed epoch (nan where not reported)

    @property
    def level(self) -> float | None:
        """Accuracy at or below which a model counts as guessing (None: not judged)."""
        return None if self.chance is None else self.chance + self.margin

    def observe(self, epoch: int, evaluation: dict) -> None:
        """One epoch's evaluation dict (``accuracy`` may be absent: nothing to judge)."""
        acc = evaluation.get("accuracy")
        if acc is None:
            return
        acc = float(acc)
        self.history.append((int(epoch), acc if math.isfinite(acc) else 0.0))
        self.losses.append(float(evaluation.get("test_loss", math.nan)))

    def progressing(self) -> bool:
        """Whether the test loss fell at every epoch (by ``PROGRESS_LOSS_DROP`` in all) while accuracy rose."""
        ls = self.losses
        if len(ls) < 2 or not all(math.isfinite(x) for x in ls):
            return False
        guess = _uniform_guess_loss(self.chance)
        if guess is None or not all(b < a for a, b in zip(ls, ls[1:])):
            return False  # no class count to compare with (chance 0), or the loss did not fall every epoch
        # below the cross-entropy of guessing uniformly among ~1/chance classes: an absurd learning rate
        # under the norm guard also has a falling loss, but at 1e9, not near ln(classes)
        return (ls[-1] <= ls[0] * (1.0 - PROGRESS_LOSS_DROP) and ls[-1] < guess
                and self.history[-1][1] > self.history[0][1])

    def failure(self) -> str | None:
        """Why the run counts as failed, or None (trained, or not judged)."""
        level = self.level
        if level is None or not self.history:
            return None
        last_epoch, last = self.history[-1]
        best_epoch, best = max(self.history, key=lambda h: (h[1], -h[0]))
        if last > level:
            return None
        tail = (f"test accuracy {last:.4f} at epoch {last_epoch + 1} is at chance ({self.chance:.4f} + margin "
                f"{self.margin:g})")
        if best >= self.chance + self.learned:
            return (f"training collapsed: {tail}, down from {best:.4f} at epoch {best_epoch + 1}; lower --lr, keep "
                    f"the divergence guard on (--clip-factor), or resume from an earlier --checkpoint-dir")
        loss = self.losses[-1] if self.losses else math.nan
        guess = _uniform_guess_loss(self.chance)
        if guess is not None and math.isfinite(loss) and loss >= DIVERGED_LOSS_FACTOR * guess:
            return (f"training diverged: {tail} with test loss {loss:.3g}, {loss / guess:.3g}x a uniform guess's "
                    f"{guess:.3g}. Check --lr: lower it (and keep the divergence guard on: --clip-factor)")
        if len(self.history) < self.min_epochs or self.progressing():
            return None
        advice = ("the loss may be finite but the model is guessing. Check --lr (too large and the model diverges, "
                  "too small and it barely moves: train more epochs) and that gradients reach the PS (delivered "
                  "fraction, dropped workers); asynchronous updates (--mode async, mlfabric) diverge with heavy "
                  "--momentum")
        if best <= level:
            return f"nothing trained: {tail} and no epoch of {len(self.history)} ever rose above it (best {best:.4f}); " + advice
        return f"training fell back to chance: {tail} after {best:.4f} at epoch {best_epoch + 1}; {advice}"
