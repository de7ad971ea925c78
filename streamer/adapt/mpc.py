"""The default policy: a receding-horizon plan over every remaining chunk, weighed over
the rates this peer has shown, its first step guarded against the worst recent rate.

Unlike robustMPC (Yin et al., SIGCOMM'15), which plans a few chunks ahead with guessed
sizes, every chunk's size at every level is known here, so the plan covers the whole rest
of the fetch (:func:`streamer.adapt.overlap.solve`: a knapsack over the deadline, text
recomputed while later chunks stream, exactly for a text prefix and in series for text
between KV chunks unless ``ANY_MIX``); only the throughput is predicted
(:mod:`streamer.adapt.estimator`). The plan is redone before every chunk and only its
first choice is used. A plan at one rate fills the budget exactly, so:

* **Scenarios.** Each option for the next chunk is scored by the mean cost of the cheapest
  plan it starts over the peer's rate scenarios (:func:`expected_costs`), plus a fade to
  ``FADE_FACTOR`` of the slowest, weighted ``FADE_WEIGHT``, for a deep fade not yet seen:
  a late text chunk costs far more than the level step that slack costs. Where the cancel
  rule can give an option up for text in time, a rate it misses at counts as all text.
* **Margin.** Plans get ``1 - PLAN_MARGIN`` of the time left, so a small late shortfall
  costs a level step, not a cancelled chunk recomputed past the deadline.
* **Order.** Text is irrevocable and measures nothing, so it goes as late as possible
  (unless its recompute must start early to hide behind transfers), to be decided with
  more information; of a mix of two levels the worse goes first, leaving slack to later
  plans made with more measurements.
* **Guard.** A requested chunk cannot be taken back: its option must leave the rest able
  to finish as text at the guard rate (:func:`guarded`); if none does, the least expected
  cost over all.
* **A level held.** A steady link's samples scatter, and a mix may put either level
  first at the same cost, so the previous chunk's level is kept while its expected cost
  is within ``HOLD_SHARE`` of the distortion step (:func:`held`).
* **A first step that leans worse.** With no previous level, the next worse one is held
  so: a plan with no prediction errors to weigh yet is the fetch's least cautious (not
  for a last chunk: no later plan is left to use the slack).
* **Probe.** Where the plan says text and the cancel rule is on, the smallest level is
  tried first, as a winnable bet (:func:`probe`) or for free while earlier text is still
  being recomputed (:func:`free_probe`); the rule gives it up if the link stays slow.

Text costs ``text_penalty`` plus its token bytes and recompute seconds; with the default
penalty (as bad as losing the chunk) it is planned only when no plan of levels fits. When
none fits at any rate, the fastest plan's first choice is returned, to miss by the least.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from streamer.adapt import overlap
from streamer.adapt.base import (TEXT, Choice, PlanInput, choice_of, link_seconds, option_costs,
                                 option_seconds, pipeline_budget, probe_level)
from streamer.adapt.cancel import abandon_seconds, give_up_seconds
from streamer.adapt.estimator import (DEFAULT_WINDOW, guard_estimate, rate_scenarios, robust_estimate,
                                      throughputs)
from streamer.adapt.plan import DEFAULT_BINS, Plan, fastest

#: Whether plans may time text between KV chunks as it overlaps (``overlap``'s any-mix
#: shape). Off: such schedules are timed in series, a bound that leaves slack. Exact
#: timing let mpc plan KV ahead of text it later had to cancel for: ``kvwire bench
#: policies`` measured more text and more misses at tight deadlines with it on (its
#: ``mpc-any-mix`` row), so it is off until the plan weighs that risk.
ANY_MIX = False

#: Share of the time left a plan keeps unused (see "Margin" above): more costs a level
#: step more often, less lets a small late shortfall turn a chunk into text.
PLAN_MARGIN = 0.03

#: The unseen fade every option is also scored against: the link at this share of the
#: slowest rate scenario, with this weight relative to all the scenarios together (see
#: "Scenarios" above). A deeper or likelier fade keeps more slack, paid in level steps,
#: against a late fade turning the last chunks into text.
FADE_FACTOR = 0.3
FADE_WEIGHT = 0.1

#: The previous chunk's level is held, against a step either way, while its expected cost
#: is within this share of the distortion step between the two (see "A level held"
#: above). Larger means fewer level switches for up to this share of a step on one chunk;
#: below 1, so a plan better by a whole step always ends the hold.
HOLD_SHARE = 0.75

#: Extra cost of text per position earlier in the plan: far below any level's distortion
#: step, so it only breaks ties between plans that differ in where their text goes.
TEXT_LATER = 1e-6
#: Extra cost of a level per position earlier and per level better: between plans that mix
#: the same levels in another order (equal in the objective), the one with its better
#: levels last (see "Order" above). At most 64 x 8 x 1e-9 per chunk, far
#: below any level's distortion step.
LEVEL_LATER = 1e-9


def plan_costs(inp: PlanInput) -> np.ndarray:
    """[chunks, options] costs: the objective, plus the tie-breaks that put text and the
    better levels last."""
    chunks = len(inp.sizes)
    costs = np.tile(option_costs(inp), (chunks, 1))
    earlier = chunks - np.arange(chunks)
    costs[:, -1] += TEXT_LATER * earlier
    levels = costs.shape[1] - 1
    costs[:, :-1] += LEVEL_LATER * earlier[:, None] * (levels - np.arange(levels))[None, :]
    return costs


def with_margin(inp: PlanInput) -> PlanInput:
    """``inp`` with the time its plans have: what the decoder adds off
    (``base.pipeline_budget``), and ``PLAN_MARGIN`` of the rest held back (none of an
    overdrawn budget)."""
    budget = pipeline_budget(inp)
    return dataclasses.replace(inp, time_left=budget * (1.0 - PLAN_MARGIN) if budget > 0 else budget)


def mpc_plan(inp: PlanInput, window: int = DEFAULT_WINDOW,
             bins: int = DEFAULT_BINS, any_mix: bool = ANY_MIX) -> Plan | None:
    """The plan at the calibrated estimate, or None with no throughput information.

    Exposed so a caller can log the predicted finish time or compare plans; its first
    column is mpc's choice unless the guard overrules it.
    """
    inp = with_margin(inp)
    estimate = robust_estimate(inp.history, window, inp.prior_bps, inp.prior_errors)
    if estimate is None:
        return None
    return overlap.solve(link_seconds(inp, estimate), inp.text_seconds, plan_costs(inp), inp.time_left,
                         inp.recompute_busy, bins, any_mix, inp.recompute_overlaps)


def expected_costs(inp: PlanInput, costs: np.ndarray, window: int = DEFAULT_WINDOW,
                   bins: int = DEFAULT_BINS, any_mix: bool = ANY_MIX) -> np.ndarray:
    """For each option of chunk 0, the mean over the rate scenarios
    (``estimator.rate_scenarios``, and the fade below the slowest of them, weighted
    ``FADE_WEIGHT``) of the cheapest plan starting with it; inf for an option that fits
    in no scenario. In a scenario in which an option starts no plan that fits, a level
    the cancel rule can give up in time for text (:func:`finish_as_text`) costs what
    the rule then leaves, every chunk as text; otherwise the option counts as every chunk
    lost and one more.

    Planning at one central rate fills the budget exactly, so a link a little slower than
    predicted turns the last chunks into text, which costs far more than the level steps
    that a little caution costs; weighing every option over the rates this peer has shown
    buys that caution where the link is erratic, and none where it is steady. Counting
    the rule's way out prices a KV chunk on a link that may be slow as the bet it is:
    the level if the link is fast, text after a wasted try if not; scored as a miss, a
    level on an erratic link lost to text against a plan that gave the chunk up at once.
    """
    miss = inp.text_penalty * len(inp.sizes) + 1.0
    all_text = float(costs[:, -1].sum())
    rates, counts = np.unique(rate_scenarios(inp.history, window, inp.prior_bps, inp.prior_errors),
                              return_counts=True)
    rates = np.append(rates, FADE_FACTOR * rates.min())
    weights = np.append(counts, FADE_WEIGHT * counts.sum())
    total = np.zeros(inp.levels + 1)
    fits = np.zeros(inp.levels + 1, dtype=bool)
    for rate, weight in zip(rates, weights):
        first = overlap.first_option_costs(link_seconds(inp, float(rate)), inp.text_seconds, costs,
                                           inp.time_left, inp.recompute_busy, bins, any_mix, inp.recompute_overlaps)
        finite = np.isfinite(first)
        fits |= finite
        if not finite.all():   # only then is the way out asked about (a decision's hot path)
            first = np.where(finite, first, np.where(finish_as_text(inp, float(rate)), all_text, miss))
        total += weight * first
    return np.where(fits, total / weights.sum(), np.inf)


def finish_as_text(inp: PlanInput, rate: float) -> np.ndarray:
    """Which options of chunk 0 leave the rest able to finish as text with the link at
    ``rate`` bytes/s: chunk 0 delivered once its bytes are in (as text: once recomputed),
    and not before the recompute already owed (``adapt.overlap``), the rest as text
    then in series. With the cancel rule on, a KV chunk that proves slow
    takes at most what giving it up for text takes (``cancel.abandon_seconds``, plus its
    text), where lower."""
    link, recompute = link_seconds(inp, rate), np.asarray(inp.text_seconds, dtype=np.float64)
    first = np.maximum(link[0], inp.recompute_busy)
    first[-1] += recompute[0]
    if inp.abandon is not None:
        given_up = abandon_seconds(rate, inp.abandon.rtt, inp.abandon.reconnect_seconds) + link[0, -1]
        first[:-1] = np.minimum(first[:-1], max(given_up, inp.recompute_busy) + recompute[0])
    return first + (link[1:, -1] + recompute[1:]).sum() <= inp.time_left


def guarded(inp: PlanInput, window: int = DEFAULT_WINDOW) -> np.ndarray:
    """Which options of chunk 0 leave the rest able to finish as text at the guard rate
    (:func:`finish_as_text`).

    With the cancel rule on, a KV chunk that proves slow costs at most what giving it up
    for text costs, so that bound applies where lower; a collapse later in the chunk is
    the rule's to catch while giving up still fits (``cancel.reconsider``).
    """
    rate = guard_estimate(inp.history, window, inp.prior_bps, inp.prior_errors)
    assert rate is not None  # only called with information
    return finish_as_text(inp, rate)


def probe(inp: PlanInput, estimate: float, safe: np.ndarray, costs: np.ndarray,
          window: int = DEFAULT_WINDOW, bins: int = DEFAULT_BINS, any_mix: bool = ANY_MIX) -> Choice | None:
    """The smallest level of chunk 0, worth trying where the plan at ``estimate`` says
    text, or None; ``safe`` is :func:`guarded`'s answer for chunk 0's options.

    Text is irrevocable and measures nothing: once a fade has pulled the estimate down,
    every later chunk would follow it to text although the link may be back. With the
    cancel rule on, a KV chunk is a cheap bet instead, when something says the link may
    be faster than the estimate (a recent sample or the prior above it, or nothing
    measured yet in this fetch) and abandoning the chunk at the guard rate still leaves
    the rest time as text: if the link is still slow the rule gives the chunk to text
    after its first bytes. The smallest level (:func:`~streamer.adapt.base.probe_level`)
    commits the fewest bytes to the bet. Once this fetch has samples, the bet must be
    winnable: a plan starting with that level must fit at the fastest of them (or the
    prior). Otherwise, on a steady link too slow for KV, every chunk would be tried and
    given up in turn, each costing a look's worth of time, until the text left comes too
    late.
    """
    if inp.abandon is None:
        return None
    rates = throughputs(inp.history)[-window:]
    column = probe_level(inp)
    if rates.size:
        hopeful = max(float(rates.max()), inp.prior_bps or 0.0)
        if not hopeful > estimate:
            return None
        first = overlap.first_option_costs(link_seconds(inp, hopeful), inp.text_seconds, costs,
                                           inp.time_left, inp.recompute_busy, bins, any_mix, inp.recompute_overlaps)
        if not np.isfinite(first[column]):
            return None   # the bet cannot win: even at the hopeful rate it misses
    return column if safe[column] else None


def mpc(inp: PlanInput, window: int = DEFAULT_WINDOW, bins: int = DEFAULT_BINS, any_mix: bool = ANY_MIX) -> Choice:
    """See the module docstring; the smallest level as a probe when nothing is known about
    the link (see :func:`streamer.adapt.base.probe_level`)."""
    estimate = robust_estimate(inp.history, window, inp.prior_bps, inp.prior_errors)
    if estimate is None:
        return probe_level(inp)
    inp = with_margin(inp)
    costs = plan_costs(inp)
    totals = expected_costs(inp, costs, window, bins, any_mix)
    if not np.isfinite(totals).any():   # nothing fits: miss by as little as possible
        quickest = choice_of(fastest(option_seconds(inp, estimate), costs).columns[0], inp.levels)
        if quickest == TEXT and not inp.recompute_overlaps:
            return shared_cores_probe(inp, estimate) or TEXT
        return quickest
    ok = guarded(inp, window)
    safe = np.where(ok, totals, np.inf)
    best = safe if np.isfinite(safe).any() else totals
    choice = choice_of(int(np.argmin(best)), inp.levels)
    if choice != TEXT:
        return held(inp, best, choice)
    tried = probe(inp, estimate, ok, costs, window, bins, any_mix)
    if tried is None:
        tried = free_probe(inp, estimate, bins, any_mix)
    return choice if tried is None else tried


def held(inp: PlanInput, totals: np.ndarray, choice: int) -> int:
    """The previous chunk's level instead of ``choice`` where its expected cost
    (``totals``, inf where unsafe) is within ``HOLD_SHARE`` of the distortion step
    between the two (see "A level held" above); with no previous level (the fetch's first
    chunk, or one after text), the level after ``choice`` is held so, as if the chunk
    before had been sent at it (see "A first step that leans worse"). A level no longer
    safe, or one where the plan says text, is never held."""
    previous = inp.previous_level
    if previous is None:
        previous = choice + 1
        if previous == inp.levels or len(inp.sizes) == 1:
            return choice   # the last chunk leaves no later plan the slack would serve
    if previous == choice or not np.isfinite(totals[previous]):
        return choice
    step = abs(inp.distortion[previous] - inp.distortion[choice])
    return previous if totals[previous] - totals[choice] <= HOLD_SHARE * step else choice


def shared_cores_probe(inp: PlanInput, estimate: float) -> Choice | None:
    """The smallest level of chunk 0 where nothing fits and text would be quickest, as a
    try, on a host where recompute and decoding share the cores; or None.

    There every text chunk costs a prefill on the cores the receiver needs, and text
    requests are tiny, so after a stall has pulled the estimate down (one upper-bound
    sample of a starved receiver is enough) every chunk left would be decided as text at
    once, at the same estimate, and each costs far more than its KV would once the link
    is measured again. Chunk 0's recompute cannot start before the one owed is done, so
    with the cancel rule on it is tried at its smallest level while that runs, if giving
    it up takes less (``cancel.give_up_seconds``): the rule judges it once the receiver
    is free again, and gives it up for text then if the link is still slow."""
    return probe_level(inp) if _given_up_in_time(inp, estimate) else None


def _given_up_in_time(inp: PlanInput, estimate: float) -> bool:
    """With the cancel rule on, a KV try of chunk 0 can be given up before the recompute
    owed for earlier text reaches it (``cancel.give_up_seconds``)."""
    return inp.abandon is not None and \
        inp.recompute_busy >= give_up_seconds(estimate, inp.abandon.rtt, inp.abandon.reconnect_seconds)


def free_probe(inp: PlanInput, estimate: float, bins: int = DEFAULT_BINS, any_mix: bool = ANY_MIX) -> Choice | None:
    """The smallest level of chunk 0 where the plan says text, as a try that costs
    nothing, or None.

    A text chunk's recompute cannot start before the caller has recomputed the text
    chunks before it (``recompute_busy``), so deciding it now gains nothing over deciding
    it then; decided at once, the whole rest of a fetch that met a slow start would go
    to text in one go (token ids are tiny, so each next request goes out at once) and the
    link would sit idle while the caller recomputes, even if it came back at once. So
    the chunk is tried at its smallest level while that recompute runs: the cancel rule
    keeps it while giving it up for text still lands before the recompute reaches it
    (``cancel.reconsider``) and gives it up then unless it is on course. The try is
    free only if the recompute owed outlasts what giving it up takes
    (``cancel.give_up_seconds``) and holding the link that long costs the rest of the
    plan nothing (a KV chunk planned behind the text would be delayed).
    """
    if not _given_up_in_time(inp, estimate):
        return None
    link = link_seconds(inp, estimate)
    # the objective alone: the tie-breaks would price moving the text behind the held link
    objective = np.tile(option_costs(inp), (len(inp.sizes), 1))
    now = overlap.first_option_costs(link, inp.text_seconds, objective, inp.time_left, inp.recompute_busy, bins,
                                     any_mix, inp.recompute_overlaps)
    link[0, -1] = max(link[0, -1], inp.recompute_busy)
    later = overlap.first_option_costs(link, inp.text_seconds, objective, inp.time_left, inp.recompute_busy, bins,
                                       any_mix, inp.recompute_overlaps)
    return probe_level(inp) if later[-1] <= now[-1] + 1e-12 else None
