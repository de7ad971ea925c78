"""The default policy: robustMPC's estimate with an exact plan over all remaining chunks.

robustMPC (Yin et al., SIGCOMM'15) plans a few chunks ahead with guessed sizes; here
every chunk's size at every level is known, so the plan covers the whole rest of
the fetch exactly (:func:`streamer.adapt.plan.solve`) and only the throughput is
predicted, pessimistically (:func:`streamer.adapt.estimator.robust_estimate`). Only the
first chunk's choice is used: the plan is redone before every chunk with the
newest measurements (receding horizon).

Text is one more option per chunk, costing ``text_penalty`` and its token bytes
plus recompute seconds; with the default penalty (as bad as losing the chunk) the
plan takes it only when no plan of levels fits the deadline. When no plan fits at
all, the fastest plan's first choice is returned, to miss the deadline by as little
as possible.
"""
from __future__ import annotations

from streamer.adapt.estimator import DEFAULT_WINDOW, robust_estimate
from streamer.adapt.base import (Choice, PlanInput, choice_of, option_costs, option_seconds,
                                 probe_level)
from streamer.adapt.plan import DEFAULT_BINS, Plan, solve


def mpc_plan(inp: PlanInput, window: int = DEFAULT_WINDOW,
             bins: int = DEFAULT_BINS) -> Plan | None:
    """The full plan behind :func:`mpc`'s choice, or None with no throughput information.

    Exposed so a caller can log the predicted finish time or compare plans.
    """
    estimate = robust_estimate(inp.history, window, inp.prior_bps)
    if estimate is None:
        return None
    return solve(option_seconds(inp, estimate), option_costs(inp), inp.time_left, bins)


def mpc(inp: PlanInput, window: int = DEFAULT_WINDOW, bins: int = DEFAULT_BINS) -> Choice:
    """First choice of the cheapest plan that fits; the smallest level as a probe when
    nothing is known about the link (see :func:`streamer.adapt.base.probe_level`)."""
    plan = mpc_plan(inp, window, bins)
    if plan is None:
        return probe_level(inp)
    return choice_of(plan.columns[0], inp.levels)
