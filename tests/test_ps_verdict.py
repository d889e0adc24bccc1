"""A run that ends at chance accuracy never reports success (ltp_ps.verdict), unit and in-memory tiers."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ltp_ps import verdict as vd
from ltp_ps.errors import TrainingFailed
from ltp_ps.verdict import AccuracyVerdict
from ps_helpers import make_job, workload

pytestmark = pytest.mark.timeout(120)

CHANCE = 0.1


def _verdict(accs, chance=CHANCE):
    v = AccuracyVerdict(chance)
    for e, a in enumerate(accs):
        v.observe(e, {"accuracy": a, "test_loss": 1.0})
    return v


# -- the rule ------------------------------------------------------------------------------------
def test_collapse_from_best_to_chance_fails_naming_both_epochs():
    why = _verdict([0.6, 0.9, 0.097]).failure()
    assert why is not None and why.startswith("training collapsed")
    assert "0.0970 at epoch 3" in why and "0.9000 at epoch 2" in why and "lower --lr" in why


def test_never_above_chance_fails_after_enough_epochs_only():
    assert _verdict([0.1]).failure() is None  # one or two epochs: not judged
    assert _verdict([0.1, 0.12]).failure() is None
    why = _verdict([0.1, 0.12, 0.09]).failure()
    assert why is not None and why.startswith("nothing trained")
    assert "no epoch of 3 ever rose above it" in why


# [0.1694, 0.1389]: 6 asynchronous mlfabric workers, 2 epochs, lr 0.1 -- slow, not broken
@pytest.mark.parametrize("accs", [[0.5], [0.11, 0.2], [0.9, 0.4, 0.16], [0.05, 0.1, 0.9], [0.1694, 0.1389]])
def test_runs_that_end_above_chance_or_are_too_short_to_judge_pass(accs):
    assert _verdict(accs).failure() is None


# [0.1889, 0.1028, 0.1, 0.1, 0.1]: 4 asynchronous workers at momentum 0.9 over LTP (TCP: 0.29 then 0.100),
# which exited 0 before the rule covered a run that learned a little and fell back
@pytest.mark.parametrize("accs", [[0.3, 0.12, 0.14, 0.13], [0.1889, 0.1028, 0.1, 0.1, 0.1], [0.2, 0.2, 0.15]])
def test_a_judged_run_that_falls_back_to_chance_fails(accs):
    why = _verdict(accs).failure()
    assert why is not None and why.startswith("training fell back to chance"), why
    assert "--momentum" in why and "Check --lr" in why


def _with_losses(accs, losses):
    v = AccuracyVerdict(CHANCE)
    for e, (a, l) in enumerate(zip(accs, losses)):
        v.observe(e, {"accuracy": a, "test_loss": l})
    return v


def test_a_slow_run_whose_test_loss_falls_every_epoch_is_not_failed():
    # 7 workers, lr 0.01, momentum 0, 3 epochs on digits: 0.106 -> 0.139, still under chance + margin
    accs = [0.106, 0.12, 0.139]
    assert _with_losses(accs, [2.30, 2.27, 2.22]).failure() is None
    # not progress: a loss that rose once, fell too little, was not reported, or accuracy that did not rise
    # (and lr 1e9 under the norm guard: the loss falls every epoch, but from 2.5e9 to 1.2e9)
    for losses in ([2.30, 2.31, 2.20], [2.30, 2.29, 2.28], [2.30, float("nan"), 2.2]):
        assert _with_losses(accs, losses).failure().startswith("nothing trained"), losses
    assert _with_losses(accs, [2.5e9, 2.2e9, 1.2e9]).failure().startswith("training diverged")
    assert _with_losses([0.13, 0.12, 0.11], [2.30, 2.27, 2.22]).failure().startswith("nothing trained")
    # a workload whose chance level is 0 states no class count: no progress can be shown against a guess
    v = AccuracyVerdict(0.0)
    for e, (a, l) in enumerate(zip([0.0, 0.01, 0.02], [2.3, 2.0, 1.5])):
        v.observe(e, {"accuracy": a, "test_loss": l})
    assert not v.progressing() and v.failure().startswith("nothing trained")
    # progress never excuses a collapse
    assert _with_losses([0.9, 0.5, 0.1], [3.0, 2.5, 2.0]).failure().startswith("training collapsed")


def test_a_diverged_run_fails_after_any_number_of_epochs():
    """Found by trying to break it: --lr 1e6 for two epochs ended at chance with a finite test loss of 3e16 and
    exited 0 (two epochs are too few for the "nothing trained" rule)."""
    for accs, losses in (([0.1], [3e16]), ([0.2, 0.1], [2.1, 3e16]), ([0.1, 0.1], [2.3e3, 2.4e3])):
        why = _with_losses(accs, losses).failure()
        assert why is not None and why.startswith("training diverged") and "Check --lr" in why, why
    assert _with_losses([0.1], [2.31]).failure() is None          # a first epoch near a uniform guess: too early
    assert _with_losses([0.1, 0.11], [2.3, 150.0]).failure() is None  # high, not absurd: left to rule 2
    assert _with_losses([0.5], [3e16]).failure() is None          # above chance: not judged on loss
    assert _with_losses([0.1], [float("inf")]).failure() is None  # non-finite loss: the NaN guard's case


def test_not_judged_without_a_chance_level_or_an_accuracy():
    assert _verdict([0.9, 0.0], chance=None).failure() is None
    v = AccuracyVerdict(CHANCE)
    for e in range(5):
        v.observe(e, {"test_loss": 3.0})  # a workload that reports no accuracy
    assert v.failure() is None and v.history == []


def test_non_finite_accuracy_counts_as_zero_and_bad_arguments_name_the_fix():
    assert _verdict([0.8, float("nan")]).failure().startswith("training collapsed")
    with pytest.raises(ValueError, match="chance_accuracy = None"):
        AccuracyVerdict(1.5)
    with pytest.raises(ValueError):
        AccuracyVerdict(0.1, min_epochs=0)
    with pytest.raises(ValueError):
        AccuracyVerdict(0.1, margin=0.3, learned=0.2)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=0, max_size=12), st.floats(0.0, 0.5))
def test_property_fails_exactly_when_the_last_epoch_is_at_chance_and_the_run_is_judged(accs, chance):
    why = _verdict(accs, chance).failure()
    level = chance + vd.CHANCE_MARGIN
    collapsed = bool(accs) and accs[-1] <= level and max(accs) >= chance + vd.LEARNED_MARGIN
    ends_at_chance = bool(accs) and accs[-1] <= level and len(accs) >= vd.MIN_JUDGED_EPOCHS  # losses flat: no progress
    judged = collapsed or ends_at_chance
    assert (why is not None) == judged


def test_digits_states_its_chance_level():
    wl = workload()
    assert 0.09 < wl.chance_accuracy < 0.12  # ten stratified classes


# -- the PS ---------------------------------------------------------------------------------------
async def _run(job):
    return await asyncio.gather(*(s.run() for s in job.servers), *(w.run() for w in job.workers),
                                return_exceptions=True)


@pytest.mark.parametrize("mode,kw", [("bsp", {}), ("async", {"momentum": 0.0})])
def test_absurd_learning_rate_with_finite_loss_fails_the_job_and_tells_the_workers(mode, kw):
    # lr 1e9 with the norm guard on: every value stays finite, the model sits at chance.
    job = make_job(2, epochs=vd.MIN_JUDGED_EPOCHS, lr=1e9, mode=mode, **kw)
    res = asyncio.run(asyncio.wait_for(_run(job), 90))
    err = res[0]
    assert isinstance(err, TrainingFailed), err
    assert "at chance" in str(err) and "Check --lr" in str(err)
    ps = job.servers[0]
    assert any(r["event"] == "failed" for r in ps.metrics.rows)
    assert all(isinstance(r, dict) and r["stopped"] for r in res[1:])  # nobody left waiting


def test_a_short_legit_run_is_not_failed():
    # Fewer rounds than one epoch: the model may still be near chance, and that is not a failure.
    job = make_job(2, iterations=3, lr=0.1)
    res = asyncio.run(asyncio.wait_for(_run(job), 60))
    assert not any(isinstance(r, BaseException) for r in res), res
