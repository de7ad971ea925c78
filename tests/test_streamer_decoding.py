"""The decoder as a pipeline stage: its measured cost (``adapt.decoding``), how the planners
and the cancel rule time it (``base.link_seconds``, ``base.pipeline_budget``), and the
delivery's record of what it decoded and still owes."""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import numpy as np
import pytest
from hypothesis import given, strategies as st

from streamer.adapt.base import TEXT, Observation, PlanInput, link_seconds, pipeline_budget, predicted_seconds
from streamer.adapt.cancel import InFlight, reconsider
from streamer.adapt.decoding import (PER_TOKEN_SHARE, RECENT_SECTIONS, STALL_FACTOR, DecodeCost, measure, measure_whole,
                                     prior_sections)
from streamer.adapt.mpc import mpc, mpc_plan
from streamer.fetch import events as ev
from streamer.net.delivery import OrderedDelivery
from streamer_helpers import held_decode


class _Header:
    """The fields of a blob header the delivery reads: a section's decoded size, and whether it is predicted."""
    raw_size = 64
    predicted = False


HEADER = _Header()

MB = 1_000_000


# ------------------------------------------------------------------ the cost
def test_no_section_decoded_means_no_cost() -> None:
    assert measure([]) is None
    assert measure([(0, 100, 0.5), (10, 0, 0.5)]) is None   # sections of no tokens or bytes are ignored


def test_the_cost_is_token_weighted_over_the_recent_sections() -> None:
    cost = measure([(100, 1000, 0.01), (1000, 10_000, 0.1)])
    assert (cost.seconds_per_token, cost.bytes_per_token) == (pytest.approx(1e-4), pytest.approx(10.0))
    slow_then_fast = [(1000, 10_000, 1.0)] + [(1000, 10_000, 0.01)] * RECENT_SECTIONS
    assert measure(slow_then_fast).seconds_per_token == pytest.approx(1e-5)


def test_sections_like_those_measured_cost_what_they_took() -> None:
    cost = measure([(512, 200_000, 0.02)] * 6)
    assert cost.seconds(512, 200_000) == pytest.approx(0.02)
    assert cost.seconds(6 * 512, 6 * 200_000) == pytest.approx(0.12)   # a chunk: its sections' sum


def test_fewer_bytes_decode_faster_but_not_in_proportion() -> None:
    """Part of a section's decode is per element: a quarter of the bytes takes more than a
    quarter of the time (PER_TOKEN_SHARE), and less than all of it."""
    cost = measure([(512, 200_000, 0.02)])
    assert 0.02 / 4 < cost.seconds(512, 50_000) < 0.02
    assert cost.seconds(512, 50_000) == pytest.approx(0.02 * (PER_TOKEN_SHARE + (1 - PER_TOKEN_SHARE) / 4))


def test_negative_seconds_are_refused() -> None:
    with pytest.raises(ValueError, match="seconds"):
        measure([(10, 10, -1.0)])


@given(st.lists(st.tuples(st.integers(1, 10_000), st.integers(1, 10**6), st.floats(0, 10)),
                min_size=1, max_size=40))
def test_the_recent_sections_together_cost_what_they_took(sections) -> None:
    """...each counted at most STALL_FACTOR times the median section's seconds per token."""
    recent = sections[-RECENT_SECTIONS:]
    cost = measure(sections)
    total = cost.seconds(sum(t for t, _, _ in recent), sum(b for _, b, _ in recent))
    median = sorted(s / t for t, _, s in recent)[len(recent) // 2]
    assert total == pytest.approx(sum(min(s, STALL_FACTOR * median * t) for t, _, s in recent),
                                  rel=1e-9, abs=1e-12)
    assert total <= sum(s for _, _, s in recent) * (1 + 1e-9) + 1e-12


def test_one_stalled_section_is_not_the_decoders_rate_but_a_slow_decoder_is() -> None:
    """A 2 s stall among 5 ms sections counts as a slow section, not as 2 s (it would price
    every later chunk as text); when most sections slow down, the cost follows."""
    steady = [(512, 20_000, 0.005)] * 11
    stalled = measure(steady + [(512, 20_000, 2.0)])
    assert stalled.seconds(512, 20_000) == pytest.approx((11 * 0.005 + STALL_FACTOR * 0.005) / 12)
    loaded = measure(steady[:4] + [(512, 20_000, 0.05)] * 8)
    assert loaded.seconds(512, 20_000) == pytest.approx((4 * 0.005 + 8 * 0.05) / 12)   # nothing clipped


# ------------------------------------------------------------------ the planners' view
def _plan(time_left: float, decode: float, chunks: int = 2, decode_busy: float = 0.0) -> PlanInput:
    """``chunks`` chunks of 1 MB / 0.25 MB at levels 0-1 (link: 100 MB/s), each decoding in
    ``decode`` seconds at either level; text: 2 kB recomputed in 10 ms."""
    return PlanInput(sizes=[[MB, MB // 4]] * chunks, text_bytes=[2000] * chunks,
                     text_seconds=[0.01] * chunks, distortion=[0.001, 0.05], time_left=time_left,
                     history=[Observation(10 * MB, 0.1)] * 4,
                     decode_seconds=[[decode, decode]] * chunks if decode else (), decode_busy=decode_busy)


def test_a_kv_option_holds_the_pipeline_for_its_transfer_or_its_decode() -> None:
    seconds = link_seconds(_plan(1.0, decode=0.05), 100 * MB)
    np.testing.assert_allclose(seconds[0], [0.05, 0.05, 2e-5])       # L1's 2.5 ms transfer waits for its decode
    np.testing.assert_allclose(link_seconds(_plan(1.0, decode=0.0), 100 * MB)[0], [0.01, 0.0025, 2e-5])
    assert predicted_seconds(_plan(1.0, decode=0.05), 1, 100 * MB) == pytest.approx(0.05)


def test_the_budget_loses_the_decode_owed() -> None:
    assert pipeline_budget(_plan(1.0, decode=0.2, decode_busy=0.3)) == pytest.approx(0.7)
    assert pipeline_budget(_plan(1.0, decode=0.0)) == 1.0


def test_mpc_takes_the_best_level_when_the_decoder_is_the_bottleneck() -> None:
    """Both levels hold the pipeline for their 0.3 s decode: the smaller one buys nothing."""
    assert mpc(_plan(1.0, decode=0.3)) == 0


def test_mpc_plans_text_when_the_decode_owed_leaves_no_time_for_kv() -> None:
    """Decoding both chunks takes 0.9 s of the 1 s left: both at level 0. With the decoder
    0.2 s behind on earlier chunks they would be delivered after 1.1 s: one goes to text
    (10 ms; placed last, so the first stays level 0)."""
    assert mpc_plan(_plan(1.0, decode=0.45)).columns == (0, 0)
    assert mpc_plan(_plan(1.0, decode=0.45, decode_busy=0.2)).columns == (0, 2)


def test_the_cancel_rule_counts_the_decode_of_what_is_still_to_arrive() -> None:
    """100 kB to go at 100 MB/s is 1 ms of link, but its sections take 0.5 s to decode (as
    would a re-requested level's): with 0.1 s left, keeping misses and text (10 ms) fits."""
    plan = _plan(0.1, decode=0.5, chunks=1)
    fast = InFlight(level=0, remaining_bytes=100_000, delivered_layers=0, remaining_decode_seconds=0.001)
    slow = InFlight(level=0, remaining_bytes=100_000, delivered_layers=0, remaining_decode_seconds=0.5)
    assert reconsider(plan, fast, rate=100 * MB, rtt=0.001, reconnect_seconds=0.01) is None
    switch = reconsider(plan, slow, rate=100 * MB, rtt=0.001, reconnect_seconds=0.01)
    assert switch is not None and (switch.choice, switch.abort) == (TEXT, False)


# ------------------------------------------------------------------ the delivery's record
async def test_the_delivery_reports_each_section_handed_and_decoded_with_its_seconds() -> None:
    release = threading.Event()
    decode = held_decode(1, release)
    observed: list = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        delivery = OrderedDelivery(chunks=1, layers=2, on_layer=None, on_text=None,
                                   observe=observed.append, executor=pool, decode=decode)
        delivery.resolve(0, 0)
        delivery.add_section(0, 0, HEADER, None, b"a")
        delivery.add_section(0, 1, HEADER, None, b"bb")
        consumer = asyncio.create_task(delivery.run())
        while not any(isinstance(e, ev.SectionDecoded) for e in observed):
            await asyncio.sleep(0.001)
        handed = [(e.chunk, e.layer, e.nbytes) for e in observed if isinstance(e, ev.SectionHanded)]
        decoded = [(e.chunk, e.layer, e.nbytes) for e in observed if isinstance(e, ev.SectionDecoded)]
        assert handed == [(0, 0, 1), (0, 1, 2)] and decoded == [(0, 0, 1)]   # layer 1 is still in the decoder
        release.set()
        await asyncio.wait_for(consumer, 5)
    decoded = [e for e in observed if isinstance(e, ev.SectionDecoded)]
    assert [(e.chunk, e.layer, e.nbytes) for e in decoded] == [(0, 0, 1), (0, 1, 2)]
    assert all(e.seconds is not None and e.seconds >= 0 for e in decoded)


# ------------------------------------------------------------------ a prior from the caller
def test_whole_chunk_decodes_give_the_cost_per_token_and_layer() -> None:
    cost = measure_whole(512, 6, 600_000, [0.05, 0.07])
    assert cost.seconds(512 * 6, 600_000) == pytest.approx(0.06)     # the mean decode
    assert cost.bytes_per_token == pytest.approx(600_000 / (512 * 6))
    with pytest.raises(ValueError, match="measure_whole"):
        measure_whole(512, 6, 600_000, [])


@given(st.floats(1e-8, 1e-3), st.floats(1.0, 1e4), st.integers(1, 4096), st.integers(1, 64))
def test_a_prior_stands_in_for_one_chunk_of_sections_that_cost_what_it_says(
        seconds_per_token, bytes_per_token, tokens, layers) -> None:
    prior = DecodeCost(seconds_per_token, bytes_per_token)
    sections = prior_sections(prior, tokens, layers)
    assert len(sections) == layers and all(t == tokens for t, _, _ in sections)
    again = measure(sections)
    assert again.seconds_per_token == pytest.approx(seconds_per_token, rel=1e-6)
    assert again.bytes_per_token == pytest.approx(max(round(bytes_per_token * tokens), 1) / tokens)


def test_the_sessions_own_sections_outweigh_a_prior_after_a_chunk() -> None:
    prior = prior_sections(DecodeCost(1e-3, 100.0), 512, 6)
    measured = [(512, 51_200, 512e-5)] * 6          # ten times faster than the prior said
    assert measure(prior + measured).seconds_per_token == pytest.approx(0.5 * (1e-3 + 1e-5))
    assert measure(prior + measured * 4).seconds_per_token == pytest.approx(1e-5)   # gone
