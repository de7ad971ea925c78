"""The default policy: an exact plan over all remaining chunks at a calibrated estimate,
whose first step is guarded against the link falling to its worst recent rate.

robustMPC (Yin et al., SIGCOMM'15) plans a few chunks ahead with guessed sizes; here
every chunk's size at every level is known, so the plan covers the whole rest of the
fetch exactly (:func:`streamer.adapt.overlap.solve`: a knapsack over the deadline, with
text recomputed while later chunks stream) and only the throughput is predicted
(:func:`streamer.adapt.estimator.robust_estimate`: calibrated, not worst-case). Only the
first chunk's choice is used: the plan is redone before every chunk with the newest
measurements (receding horizon).

Nine rules come from what a plan at one rate cannot see:

* **Weighed over the rates this peer has shown.** A plan at one central rate fills the
  budget exactly, so a link a little slower than predicted turns the last chunks into
  text: each first option is scored by the mean, over rates at several quantiles of
  the peer's recent prediction errors (:func:`streamer.adapt.estimator.rate_scenarios`),
  of the cheapest plan it starts (:func:`expected_costs`). A steady peer has one rate
  and gets the plain plan; an erratic one buys a little caution where text would be dear.
  Where a level starts no plan that fits at some rate but the cancel rule could give it
  up for text in time, it is scored as what the rule then leaves (every chunk as text),
  not as a miss: a bet that wins at the fast rates and loses a try at the slow ones.
* **Text last, unless in front pays.** Sending a chunk as text is irrevocable and
  teaches nothing about the link (token ids are a few kB), while a KV chunk is a
  measurement. When a plan needs some text, text is therefore placed as late as possible
  (its cost grows by a negligible amount per position earlier), so the decision can be
  redone with more information before it is taken; only a plan that needs its text in
  front, where its recompute hides behind the later transfers, puts it there.
* **Better levels last.** A budget between two levels is met by a mix of them, and
  every order of a mix costs the same; left to rounding, the plan's first chunk took
  the better level of the mix as often as not, and the next plan, with the budget that
  left, the worse one (``kvwire demo``: levels 0, 1, 1, 2, 2 over a steady link). The
  first chunk takes the worse level of the mix, so what it saves is slack for the plans
  after it, made with more measurements, which spend it on the last chunks (unless the
  chunk before was at the mix's better level: then that level is held, below).
* **A level held.** A steady link's samples still scatter around its rate (a shaper's
  bucket lets a chunk after an idle gap through faster, a busy receiver stamps arrivals
  late), and a plan mixing two levels may put either first at the same cost, so the
  levels followed the scatter: ``kvwire demo`` sent 1, 0, 2, 2, 1, 1, 2 over its steady
  200 Mbit/s (a warm run at 1ea9449). Where the plan would change level from the previous
  chunk's, that level is kept while its expected cost is within ``HOLD_SHARE`` (three
  quarters) of the distortion step between the two: free while the plan still mixes the
  held level in, less than a step on one chunk otherwise, and the next plan decides
  afresh; a plan better on every chunk left by a whole step ends the hold, and a level no
  longer safe, or one where the plan says text, is never held. Measured with ``kvwire
  bench policies``'s sweep on both sets at 0.5/1/2 s (an ad hoc script over
  ``sweep_sets``, at 1ea9449 plus the rule against a step up only): objective over the
  oracle's lower on all six lines (default 1.096/1.194/1.245 -> 1.092/1.193/1.243x,
  unseen 1.315/1.414/1.368 -> 1.311/1.402/1.354x), level switches per fetch 15-30%
  fewer; shares of 0.25, 0.5 and 0.9 within 0.01 of them; 1.5 (never a single step)
  all but stopped switching and cost 1.243 -> 1.275x on the default set at 2 s. A step
  down was first left unheld (the better level's budget goes to the last chunks, as
  above), and a cold ``kvwire demo`` then went 1, 1, 1, 2, 1, 1, 1 over the steady
  stretch on one 181 Mbit/s sample; held both ways, ``kvwire bench policies --workers 2
  --json`` (4f7bdd3's tree, the policy code 6050069 has, -> this rule) gives the same
  violations and text shares on all six lines, objective ratios within 0.001 (default
  1.0924/1.1936/1.2436 -> 1.0924/1.1936/1.2434x, unseen 1.3153/1.4138/1.3401 ->
  1.3158/1.4128/1.3399x) and 1.5-3.5% fewer level switches.
* **A first step that leans worse.** A fetch's first chunk has no level to hold, and its
  plan is the fetch's least cautious: a fresh peer has no prediction errors yet, so it
  is weighed at one rate (and the fade below), and where that rate fits all but every
  chunk at the better of two levels the plan starts with it; the plans after it weigh
  the first samples' scatter, find the better level no longer fits, and step down
  within the steady stretch (cold ``kvwire demo`` runs at 7aacf91: levels 0, 0, 0, 0, 1
  and 0, 0, 1, 1 over the steady 200 Mbit/s in 2 of 6; a dump of a warm run's decisions
  had level 0 ahead of level 1 by 3% of the step at the first chunk). So with no level
  before it (the fetch's first chunk, or one after text) a chunk holds the level after
  the plan's choice as if the chunk before had been sent at it, within ``HOLD_SHARE``,
  and the hold keeps it against a small step up after that. On that dump's first
  decision, with the profile's sample set to 150-258 Mbit/s in steps of 4, the first
  level above 186 Mbit/s went from 0 or 1 (12 and 6 of the 18 rates) to 1 at every
  one; below it, from 1 or 2 to 2 (but at 182). The share was
  swept on the committed trace set (``kvwire bench policies --workers 2 --json`` with
  0, 0.1, 0.25, 0.5 and 0.75 of the step, the hold's share the best there: objective
  over the oracle's at SLO 0.5/1/2 s 1.0924/1.1936/1.2434x without the rule,
  1.0910/1.1791/1.2412x with it); on the unseen set 1.3158/1.4128/1.3399 ->
  1.3093/1.4041/1.3348x; violations unchanged on all six lines, text shares down by
  up to 0.4 points, level switches per fetch up at 0.5 s (0.65 -> 0.75 and 0.53 ->
  0.54), down at 1 and 2 s.
* **A margin.** Plans are made for ``1 - PLAN_MARGIN`` of the time left. A chunk's rate
  varies within it, and a plan that fills the budget exactly turns a small shortfall
  late in the fetch into a cancelled chunk recomputed from text (a whole text penalty,
  and the recompute then runs past the deadline) where a margin costs at most a level
  step somewhere. The sweep of ``kvwire bench policies`` (its ``sweep_sets`` on the
  command's inputs, commit 6e1c3c6, format 5 level sizes; the 0 and 3% rows are what the
  command itself printed at 5afc79d and b34cf3e) with margins 0, 3% and 6%: objective
  over the oracle's 1.15/1.26/1.33x (0), 1.13/1.26/1.31x (3%), 1.13/1.27/1.30x (6%) on
  the committed traces at SLO 0.5/1/2 s and 1.47/1.58/1.53x, 1.47/1.56/1.51x,
  1.47/1.57/1.53x on the second set; violations at 0.5 s 2.1/2.1/1.8% and 3.2/2.8/2.5%;
  text at 1 s on the second set 40/39.5/39.6%.
* **Hedged against a fade not seen yet.** The peer's recent errors say how its rate
  varied in what was measured; a deep fade that did not happen in that window (links
  shared with bursty traffic fade rarely, then deeply) is not among the scenarios, and a
  plan that fills the budget at the rates seen turns a late fade into text chunks (1.0
  each in the objective) where the slack that would have absorbed it costs a level step
  (0.001-0.01). So every option is also scored with the link at ``FADE_FACTOR`` of the
  slowest scenario, weighted ``FADE_WEIGHT`` of the others together (~9% likely). Both
  were chosen on the committed trace set alone (``kvwire bench policies``'s sweep at SLO
  0.5/1/2 s, factor 0.2/0.3/0.4 x weight 0.1/0.2/0.3: all within 0.01 of each other,
  this one lowest at 1 s), then measured on the unseen set: see the README.
* **A guarded first step.** A requested chunk cannot be taken back. Its option must
  leave the rest of the fetch able to finish as text even if this chunk arrives at the
  *guard* rate (:func:`streamer.adapt.estimator.guard_estimate`: the worst recent
  shortfall on this peer). Among the options that pass, the one with the least expected
  cost is taken; if none passes, the least expected cost over all.
* **Text decided when the recompute reaches it.** Where the plan says text while the
  caller is still recomputing earlier text chunks, the chunk is first tried at its
  smallest level for free (:func:`free_probe`): the cancel rule gives it up for text by
  the time the recompute reaches it, unless the link came back meanwhile. On the unseen
  set at 0.5 s this took the text share from 60.9% to 57.5% of chunks (``kvwire bench
  policies``, 7bdc14b and 091cce4).

Text costs ``text_penalty`` plus its token bytes and recompute seconds (``adapt.overlap``
says when these overlap the transfers); with the
default penalty (as bad as losing the chunk) the plan takes it only when no plan of
levels fits the deadline. When no plan fits at any of the rates, the fastest plan's first
choice is returned, to miss the deadline by as little as possible.
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

#: Share of the time left a plan keeps unused (see "A margin" above).
PLAN_MARGIN = 0.03

#: The unseen fade every option is also scored against: the link at this share of the
#: slowest rate scenario, with this weight relative to all the scenarios together (see
#: "Hedged against a fade not seen yet" above).
FADE_FACTOR = 0.3
FADE_WEIGHT = 0.1

#: The previous chunk's level is held, against a step either way, while its expected cost
#: is within this share of the distortion step between the two (see "A level held" above).
HOLD_SHARE = 0.75

#: Extra cost of text per position earlier in the plan: far below any level's distortion
#: step, so it only breaks ties between plans that differ in where their text goes.
TEXT_LATER = 1e-6
#: Extra cost of a level per position earlier and per level better: between plans that mix
#: the same levels in another order (equal in the objective), the one with its better
#: levels last (see "Better levels last" above). At most 64 x 8 x 1e-9 per chunk, far
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
             bins: int = DEFAULT_BINS) -> Plan | None:
    """The plan at the calibrated estimate, or None with no throughput information.

    Exposed so a caller can log the predicted finish time or compare plans; its first
    column is mpc's choice unless the guard overrules it.
    """
    inp = with_margin(inp)
    estimate = robust_estimate(inp.history, window, inp.prior_bps, inp.prior_errors)
    if estimate is None:
        return None
    return overlap.solve(link_seconds(inp, estimate), inp.text_seconds, plan_costs(inp), inp.time_left,
                         inp.recompute_busy, bins)


def expected_costs(inp: PlanInput, costs: np.ndarray, window: int = DEFAULT_WINDOW,
                   bins: int = DEFAULT_BINS) -> np.ndarray:
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
                                           inp.time_left, inp.recompute_busy, bins)
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
          window: int = DEFAULT_WINDOW, bins: int = DEFAULT_BINS) -> Choice | None:
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
    prior). Otherwise, on a steady link too slow for KV, every chunk was tried and given
    up in turn, each costing a look's worth of time, until the text left came too late
    (``kvwire bench policies``, unseen set at 0.5 s: trace mmf-02).
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
                                           inp.time_left, inp.recompute_busy, bins)
        if not np.isfinite(first[column]):
            return None   # the bet cannot win: even at the hopeful rate it misses
    return column if safe[column] else None


def mpc(inp: PlanInput, window: int = DEFAULT_WINDOW, bins: int = DEFAULT_BINS) -> Choice:
    """See the module docstring; the smallest level as a probe when nothing is known about
    the link (see :func:`streamer.adapt.base.probe_level`)."""
    estimate = robust_estimate(inp.history, window, inp.prior_bps, inp.prior_errors)
    if estimate is None:
        return probe_level(inp)
    inp = with_margin(inp)
    costs = plan_costs(inp)
    totals = expected_costs(inp, costs, window, bins)
    if not np.isfinite(totals).any():   # nothing fits: miss by as little as possible
        return choice_of(fastest(option_seconds(inp, estimate), costs).columns[0], inp.levels)
    ok = guarded(inp, window)
    safe = np.where(ok, totals, np.inf)
    best = safe if np.isfinite(safe).any() else totals
    choice = choice_of(int(np.argmin(best)), inp.levels)
    if choice != TEXT:
        return held(inp, best, choice)
    tried = probe(inp, estimate, ok, costs, window, bins)
    if tried is None:
        tried = free_probe(inp, estimate, costs, bins)
    return choice if tried is None else tried


def held(inp: PlanInput, totals: np.ndarray, choice: int) -> int:
    """The previous chunk's level instead of ``choice`` where its expected cost
    (``totals``, inf where unsafe) is within ``HOLD_SHARE`` of the distortion step
    between the two (see "A level held" above); with no previous level, the level after
    ``choice`` is held so (see "A first step that leans worse")."""
    previous = inp.previous_level
    if previous is None:
        previous = choice + 1
        if previous == inp.levels:
            return choice
    if previous == choice or not np.isfinite(totals[previous]):
        return choice
    step = abs(inp.distortion[previous] - inp.distortion[choice])
    return previous if totals[previous] - totals[choice] <= HOLD_SHARE * step else choice


def free_probe(inp: PlanInput, estimate: float, costs: np.ndarray, bins: int = DEFAULT_BINS) -> Choice | None:
    """The smallest level of chunk 0 where the plan says text, as a try that costs
    nothing, or None.

    A text chunk's recompute cannot start before the caller has recomputed the text
    chunks before it (``recompute_busy``), so deciding it now gains nothing over deciding
    it then; sent at once, the whole rest of a fetch that met a slow start went to text
    in one go (its token ids are tiny, so each next request went out at once) and the
    link sat idle while the caller recomputed (``kvwire bench policies``, unseen set at
    0.5 s: all 8 chunks text on trace mmf-08 where the link came back within 0.1 s). So
    the chunk is tried at its smallest level while that recompute runs: the cancel rule
    keeps it while giving it up for text still lands before the recompute reaches it
    (``cancel.reconsider``) and gives it up then unless it is on course. The try is
    free only if the recompute owed outlasts what giving it up takes
    (``cancel.give_up_seconds``) and holding the link that long costs the rest of the
    plan nothing (a KV chunk planned behind the text would be delayed).
    """
    if inp.abandon is None:
        return None
    if inp.recompute_busy < give_up_seconds(estimate, inp.abandon.rtt, inp.abandon.reconnect_seconds):
        return None
    link = link_seconds(inp, estimate)
    now = overlap.first_option_costs(link, inp.text_seconds, costs, inp.time_left, inp.recompute_busy, bins)
    link[0, -1] = max(link[0, -1], inp.recompute_busy)
    later = overlap.first_option_costs(link, inp.text_seconds, costs, inp.time_left, inp.recompute_busy, bins)
    return probe_level(inp) if later[-1] <= now[-1] + 1e-12 else None
