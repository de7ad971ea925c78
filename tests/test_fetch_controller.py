"""FetchController driven by hand-made inputs alone: no sockets, threads or clocks.

Each test feeds timestamped events and checks the actions, as h11's and aioquic's tests
drive their state machines with bytes and invented times.
"""
from __future__ import annotations

import dataclasses

import pytest

from streamer.adapt import cancel, decoding
from streamer.adapt.base import TEXT
from streamer.fetch import controller as controller_module
from streamer.fetch import events as ev
from streamer.fetch.controller import Beliefs, FetchController, FetchSettings
from streamer.wire.manifest import ChunkInfo, Manifest

LAYERS = 4
TARGETS = (2.5e-4, 1e-3, 4.2e-3)


def make_manifest(sizes: list[list[int]], tokens: int = 256, text_bytes: int = 3000) -> Manifest:
    chunks = [ChunkInfo(i, i * tokens, (i + 1) * tokens, tuple(row), text_bytes, 0) for i, row in enumerate(sizes)]
    return Manifest("ctx", "v1", LAYERS, 2, 8, "float16", tokens * len(sizes), "prof", TARGETS[:len(sizes[0])],
                    tuple(chunks), 0.0)


def controller(sizes, *, policy="fixed:0", slo=10.0, beliefs=Beliefs(), record=False, **settings) -> FetchController:
    return FetchController(make_manifest(sizes), FetchSettings(slo=slo, policy=policy, **settings),
                           context_id="ctx", beliefs=beliefs, record=record)


def feed(ctl: FetchController, *events: ev.Event) -> list[ev.Action]:
    out: list[ev.Action] = []
    for event in events:
        ctl.handle(event)
        out += ctl.actions()
    return out


def whole_answer(chunk: int, size: int, at: float, sections: int = LAYERS) -> list[ev.Event]:
    """An answer arriving in one go at ``at``."""
    return [ev.AnswerBegan(chunk, size, at), ev.PartArrived(chunk, size, sections, at), ev.AnswerEnded(chunk, False, at)]


def delivered(chunk: int, at: float) -> list[ev.Event]:
    return [*(ev.LayerDelivering(chunk, layer, at) for layer in range(LAYERS)), ev.ChunkDone(chunk, at)]


# ------------------------------------------------------------------ requests
def test_the_first_request_goes_out_at_start_and_the_next_one_just_in_time() -> None:
    """With a 10 MB/s prior and a 10 ms round trip the next request waits until the bytes
    still due would take about one round trip (plus a minimum sample)."""
    rate = 10e6
    ctl = controller([[1_000_000, 500_000]] * 2, beliefs=Beliefs(prior_bps=rate))
    assert feed(ctl, ev.Started(0.01, 0.04, 0.0)) == [ev.SendRequest(0, 0)]
    assert feed(ctl, ev.AnswerBegan(0, 1_000_000, 0.01), ev.PartArrived(0, 500_000, 2, 0.06)) == []
    due = ctl.timer()
    assert due is not None and 0.06 < due < 0.11
    # the controller wants a look once the head has enough bytes in (the simulator wakes it
    # there); the link keeps its rate, so the request goes out then
    chunk, wanted = ctl.watermark()  # type: ignore[misc]
    assert chunk == 0 and 1_000_000 - wanted == pytest.approx(rate * 0.01 + 64 * 1024, abs=1)
    assert feed(ctl, ev.PartArrived(0, wanted, 3, 0.01 + wanted / rate)) == [ev.SendRequest(1, 0)]


def test_requests_go_out_as_far_ahead_as_recent_answers_took_to_begin() -> None:
    """Chunk 1's answer begins 67 ms after its request, 50 ms after the link went idle (a
    sender slow to read its store): the next request goes out that far ahead of the bytes
    running out, not one round trip. An answer that begins as the one before it ends
    waited behind it, which says nothing of the sender's time, and is not counted."""
    rate = 10e6
    ctl = controller([[1_000_000]] * 3, beliefs=Beliefs(prior_bps=rate))
    feed(ctl, ev.Started(0.01, 0.04, 0.0), ev.AnswerBegan(0, 1_000_000, 0.01))
    assert ctl.response_latency == pytest.approx(0.01)
    _, wanted = ctl.watermark()  # type: ignore[misc]
    asked = 0.01 + wanted / rate
    assert feed(ctl, ev.PartArrived(0, wanted, 3, asked)) == [ev.SendRequest(1, 0)]
    feed(ctl, ev.PartArrived(0, 1_000_000, 4, 0.11), ev.AnswerEnded(0, False, 0.11))
    feed(ctl, ev.AnswerBegan(1, 1_000_000, 0.16), ev.PartArrived(1, 100_000, 1, 0.17))
    assert ctl.response_latency == pytest.approx(0.16 - asked)
    _, wanted = ctl.watermark()  # type: ignore[misc]
    _, estimate = ctl._estimate(0.17)
    assert 1_000_000 - wanted == pytest.approx(estimate * (0.16 - asked) + 64 * 1024, abs=1)
    feed(ctl, ev.PartArrived(1, wanted, 3, 0.16 + wanted / rate))
    feed(ctl, ev.PartArrived(1, 1_000_000, 4, 0.27), ev.AnswerEnded(1, False, 0.27), ev.AnswerBegan(2, 1_000_000, 0.27))
    assert ctl.response_latency == pytest.approx(0.16 - asked)


def test_a_text_chunk_is_refused_before_it_is_requested_when_nothing_consumes_text() -> None:
    ctl = controller([[1_000_000]], policy="text", text_consumable=False)
    actions = feed(ctl, ev.Started(0.01, 0.04, 0.0))
    assert len(actions) == 1 and isinstance(actions[0], ev.Fail) and actions[0].kind == ev.TEXT_NOT_CONSUMED
    assert "chunk 0 has to come as text" in actions[0].message and "on_text" in actions[0].message
    assert feed(ctl, ev.Tick(1.0)) == [] and ctl.timer() is None


# ------------------------------------------------------------------ the report
def test_every_byte_that_arrives_counts_even_in_an_answer_a_reset_cut() -> None:
    """100 kB of chunk 0 arrive, the connection breaks, the chunk is re-requested and
    arrives whole: the report counts both (the bytes crossed the link either way)."""
    ctl = controller([[400_000]])
    feed(ctl, ev.Started(0.01, 0.04, 0.0), ev.AnswerBegan(0, 400_000, 0.01), ev.PartArrived(0, 100_000, 1, 0.02))
    assert feed(ctl, ev.ConnectionBroken("connection lost", 0.03)) == [ev.Reconnect("connection lost", False)]
    assert feed(ctl, ev.Connected(0.01, 0.04, 0.1)) == [ev.SendRequest(0, 0)]
    feed(ctl, *whole_answer(0, 400_000, 0.2), *delivered(0, 0.21))
    report = ctl.finish(0.3)
    assert report.bytes == 500_000 and report.chunks[0].retries == 1 and report.reconnects == 1
    assert ctl.done and report.total_seconds == pytest.approx(0.21)


def test_a_connection_lost_after_everything_was_delivered_is_moot() -> None:
    ctl = controller([[400_000]])
    feed(ctl, ev.Started(0.01, 0.04, 0.0), ev.AnswerBegan(0, 400_000, 0.01), ev.PartArrived(0, 400_000, 4, 0.02),
         *delivered(0, 0.03))
    assert not ctl.done   # its answer's end is still due
    assert feed(ctl, ev.ConnectionBroken("connection closed", 0.04)) == []
    assert ctl.done and ctl.finish(0.05).reconnects == 0


# ------------------------------------------------------------------ faults
def test_a_stall_reconnects_and_too_many_reconnects_fail_the_fetch() -> None:
    ctl = controller([[400_000]], stall_timeout=0.5, max_reconnects=1)
    feed(ctl, ev.Started(0.01, 0.04, 0.0))
    assert ctl.timer() == pytest.approx(0.5)   # no data since the request
    assert feed(ctl, ev.Tick(0.49)) == []
    assert feed(ctl, ev.Tick(0.5)) == [ev.Reconnect("no data for 0.5 s", False)]
    assert ctl.timer() is None                 # nothing to time while reconnecting
    assert feed(ctl, ev.Connected(0.01, 0.04, 0.6)) == [ev.SendRequest(0, 0)]
    # reading paused by the driver: silence is not a stall
    feed(ctl, ev.ReadingPaused(0.7))
    assert ctl.timer() is None
    feed(ctl, ev.ReadingResumed(0.8))
    actions = feed(ctl, ev.Tick(1.3))
    assert len(actions) == 1 and isinstance(actions[0], ev.Fail) and actions[0].kind == ev.GAVE_UP
    assert "giving up after 1 reconnects" in actions[0].message


def test_a_pause_in_reading_is_not_counted_as_the_links_time() -> None:
    """1 MB arrives in 30 ms of reading around a 1 s pause (the receiver's backlog over
    budget): the sample is the link's 30 ms, not 1.03 s, and no look judges the chunk
    while the silence is ours."""
    ctl = controller([[1_000_000]] * 2, policy="mpc", slo=5.0)
    feed(ctl, ev.Started(0.01, 0.04, 0.0))
    feed(ctl, ev.AnswerBegan(0, 1_000_000, 0.02), ev.PartArrived(0, 100_000, 1, 0.03), ev.ReadingPaused(0.03))
    assert ctl.timer() is None
    feed(ctl, ev.ReadingResumed(1.03), ev.PartArrived(0, 1_000_000, 4, 1.05), ev.AnswerEnded(0, False, 1.05))
    sample = ctl.history[-1]
    assert sample.bytes == 1_000_000 and sample.busy_seconds == pytest.approx(0.04)


@pytest.mark.parametrize("overlaps, busy", [(True, 1.035), (False, 0.035)])
def test_a_recompute_on_the_decoders_cores_is_not_the_links_time(overlaps, busy) -> None:
    """Chunk 1's megabyte arrives around a 1 s recompute of chunk 0. Where recompute runs
    beside the receiver (a GPU) that is the link's time; where it shares the receiver's
    cores, the receiver was starved meanwhile and the link is measured without it."""
    ctl = controller([[1_000_000]] * 2, policy="fixed:0", slo=5.0, recompute_overlaps=overlaps)
    feed(ctl, ev.Started(0.01, 0.04, 0.0))
    feed(ctl, ev.AnswerBegan(0, 1_000_000, 0.005), ev.PartArrived(0, 1_000_000, 4, 0.005),
         ev.AnswerEnded(0, False, 0.005))
    feed(ctl, ev.AnswerBegan(1, 1_000_000, 0.02), ev.PartArrived(1, 100_000, 1, 0.03),
         ev.RecomputeStarted(0, 0.03), ev.RecomputeFinished(0, 256, 1.0, 1.03),
         ev.PartArrived(1, 1_000_000, 4, 1.05), ev.AnswerEnded(1, False, 1.05))
    assert ctl.history[-1].busy_seconds == pytest.approx(busy)


def test_a_corrupt_section_refetches_and_a_third_one_sends_the_chunk_as_text() -> None:
    ctl = controller([[400_000]])
    feed(ctl, ev.Started(0.01, 0.04, 0.0), ev.AnswerBegan(0, 400_000, 0.01), ev.PartArrived(0, 100_000, 1, 0.02),
         ev.SectionHanded(0, 0, 100_000, 0.02), ev.LayerDelivering(0, 0, 0.03))
    assert feed(ctl, ev.Corrupt(0, 1, "checksum", 0.04)) == []     # refetched when its answer ends
    assert feed(ctl, ev.PartArrived(0, 400_000, 4, 0.05), ev.AnswerEnded(0, False, 0.05)) == [
        ev.ChunkFinished(0), ev.SendRequest(0, 0)]
    for attempt in range(2):
        actions = feed(ctl, ev.AnswerBegan(0, 400_000, 0.1 + attempt), ev.Corrupt(0, 1, "checksum", 0.11 + attempt),
                       ev.PartArrived(0, 400_000, 4, 0.12 + attempt), ev.AnswerEnded(0, False, 0.12 + attempt))
    assert actions[-1] == ev.SendRequest(0, TEXT)   # the delivered layer 0 is superseded
    feed(ctl, ev.TextArrived(0, 3000, 2.0), ev.RecomputeStarted(0, 2.0), ev.RecomputeFinished(0, 256, 0.1, 2.1),
         ev.ChunkDone(0, 2.1))
    report = ctl.finish(2.2)
    assert report.chunks[0].level == TEXT and report.chunks[0].superseded_layers == 1
    assert report.chunks[0].retries == 3 and "corrupt data: checksum" in report.chunks[0].reason


def test_a_sender_error_sends_an_untouched_chunk_as_text_and_fails_one_with_layers_out() -> None:
    ctl = controller([[400_000]] * 2)
    feed(ctl, ev.Started(0.01, 0.04, 0.0))
    assert feed(ctl, ev.SenderError("not_found", "gone", 0.02))[0] == ev.SendRequest(0, TEXT)
    ctl = controller([[400_000]] * 2)
    feed(ctl, ev.Started(0.01, 0.04, 0.0), ev.AnswerBegan(0, 400_000, 0.01), ev.LayerDelivering(0, 0, 0.02))
    actions = feed(ctl, ev.SenderError("unavailable", "store down", 0.03))
    assert actions == [ev.Fail(ev.SERVER_ERROR, "unavailable: chunk 0: store down", "unavailable")]


# ------------------------------------------------------------------ the cancel rule
def _switch_once(choice, abort=False, escalate_after=0.2):
    """A cancel rule that gives up the first chunk it is asked about (and no other)."""
    asked: list[int] = []

    def reconsider(plan, head, **_):
        asked.append(head.level)
        return cancel.Switch(choice, abort, escalate_after) if len(asked) == 1 else None
    return reconsider


def test_without_continuations_a_chunk_with_a_layer_out_goes_to_text(monkeypatch) -> None:
    """On a version 1 connection: the rule gives chunk 0 up for level 1; before the
    CANCEL's answer, the consumer's (async) on_layer starts on its layer 0: the whole chunk
    at level 1 would deliver that layer twice, so the chunk is re-requested as text, which
    supersedes it."""
    monkeypatch.setattr(controller_module.cancel, "reconsider", _switch_once(1))
    ctl = controller([[1_000_000, 500_000]] * 2, policy="mpc", beliefs=Beliefs(prior_bps=1e6))
    feed(ctl, ev.Started(0.01, 0.04, 0.0))
    actions = feed(ctl, ev.AnswerBegan(0, 1_000_000, 0.01), ev.PartArrived(0, 300_000, 1, 0.2))
    assert actions == [ev.SendCancel(0)] and ctl.switches[0].delivered_layers == 0
    feed(ctl, ev.SectionHanded(0, 0, 250_000, 0.2), ev.LayerDelivering(0, 0, 0.21))
    assert feed(ctl, ev.AnswerEnded(0, True, 0.35))[0] == ev.SendRequest(0, TEXT)
    assert ctl.chunk_report(0).cancelled_levels == [0]


def test_with_continuations_the_layers_not_delivered_continue_at_the_lower_level(monkeypatch) -> None:
    """The same switch on a connection that takes continuations: the chunk is re-requested
    at level 1 from the first layer not delivered when the request goes out (layer 2: two
    went out while the CANCEL drained), its answer's size is the sender's (the manifest
    keeps no per-layer sizes), and the report lists both runs."""
    monkeypatch.setattr(controller_module.cancel, "reconsider", _switch_once(1))
    ctl = controller([[1_000_000, 500_000]] * 2, policy="mpc", beliefs=Beliefs(prior_bps=1e6))
    feed(ctl, ev.Started(0.01, 0.04, 0.0, continuations=True))
    assert feed(ctl, ev.AnswerBegan(0, 1_000_000, 0.01), ev.PartArrived(0, 300_000, 1, 0.2)) == [ev.SendCancel(0)]
    feed(ctl, ev.SectionHanded(0, 0, 250_000, 0.2), ev.LayerDelivering(0, 0, 0.21),
         ev.PartArrived(0, 520_000, 2, 0.3), ev.SectionHanded(0, 1, 250_000, 0.3), ev.LayerDelivering(0, 1, 0.31))
    assert feed(ctl, ev.AnswerEnded(0, True, 0.35))[0] == ev.SendRequest(0, 1, first_layer=2)
    # an estimate until CHUNK_BEGIN: the header and half the sections
    assert ctl.chunks[0].expected == ctl.manifest.answer_bytes(0, 1, 2) < 500_000
    assert feed(ctl, ev.AnswerBegan(0, 251_000, 0.4)) == []           # the sender's count stands
    feed(ctl, ev.PartArrived(0, 251_000, 4, 0.6), ev.AnswerEnded(0, False, 0.6),
         ev.LayerDelivering(0, 2, 0.61), ev.LayerDelivering(0, 3, 0.62), ev.ChunkDone(0, 0.62))
    report = ctl.finish(0.7).chunks[0]
    assert report.level == 1 and report.layer_levels == [(0, 0), (2, 1)] and report.superseded_layers == 0
    assert report.cancelled_levels == [0] and "continued at level 1 from layer 2" in report.reason


def test_a_continuation_larger_than_its_blob_is_refused() -> None:
    """A CHUNK_BEGIN for a continuation names its own size, but never more than the whole
    blob's: a sender that claims more is not believed (the connection is dropped)."""
    ctl = controller([[400_000]])
    feed(ctl, ev.Started(0.01, 0.04, 0.0, continuations=True), ev.AnswerBegan(0, 400_000, 0.01),
         ev.PartArrived(0, 100_000, 1, 0.02), ev.SectionHanded(0, 0, 100_000, 0.02), ev.LayerDelivering(0, 0, 0.03),
         ev.Corrupt(0, 1, "checksum", 0.04))
    # the refetch resumes past the delivered layer, at the same level
    assert feed(ctl, ev.PartArrived(0, 400_000, 4, 0.05), ev.AnswerEnded(0, False, 0.05)) == [
        ev.ChunkFinished(0), ev.SendRequest(0, 0, first_layer=1)]
    actions = feed(ctl, ev.AnswerBegan(0, 400_001, 0.1))
    assert len(actions) == 1 and isinstance(actions[0], ev.Reconnect) and "whole blob 400000" in actions[0].reason
    assert ctl.chunk_report(0).layer_levels == [(0, 0)]   # a refetch at the same level is one run


def test_a_cancelled_answer_with_every_layer_in_is_whole(monkeypatch) -> None:
    """The CANCEL stopped the answer only after its last section was cut: nothing is left
    to re-request, the chunk completes at its level."""
    monkeypatch.setattr(controller_module.cancel, "reconsider", _switch_once(TEXT))
    ctl = controller([[1_000_000, 500_000]], policy="mpc", beliefs=Beliefs(prior_bps=1e6))
    feed(ctl, ev.Started(0.01, 0.04, 0.0, continuations=True))
    assert feed(ctl, ev.AnswerBegan(0, 1_000_000, 0.01), ev.PartArrived(0, 300_000, 1, 0.2)) == [ev.SendCancel(0)]
    actions = feed(ctl, ev.PartArrived(0, 1_000_000, 4, 0.3), ev.AnswerEnded(0, True, 0.3))
    assert actions == [ev.ChunkFinished(0)] and ctl.chunks[0].choice == 0


def test_every_cancelled_chunk_escalates_not_only_the_head(monkeypatch) -> None:
    """Chunk 0 is given up with chunk 1 queued behind it; chunk 0's answer crosses its
    CANCEL and ends whole; chunk 1 becomes the head with its CANCEL unanswered: past the
    switch's deadline the connection is dropped, not waited on for the stall timeout."""
    monkeypatch.setattr(controller_module.cancel, "reconsider", _switch_once(TEXT, escalate_after=0.2))
    ctl = controller([[1_000_000, 500_000]] * 3, policy="mpc", beliefs=Beliefs(prior_bps=1e8), stall_timeout=5.0)
    assert feed(ctl, ev.Started(0.01, 0.04, 0.0)) == [ev.SendRequest(0, 0), ev.SendRequest(1, 0)]
    actions = feed(ctl, ev.AnswerBegan(0, 1_000_000, 0.01), ev.PartArrived(0, 950_000, 3, 0.06))
    assert actions == [ev.SendCancel(0), ev.SendCancel(1)]
    feed(ctl, ev.PartArrived(0, 1_000_000, 4, 0.07), ev.AnswerEnded(0, False, 0.07))   # crossed its CANCEL
    assert ctl.timer() == pytest.approx(0.26)
    assert feed(ctl, ev.Tick(0.26)) == [ev.Reconnect("cancel: the abandoned chunk's queued bytes are not draining",
                                                     True)]
    # on the new connection chunk 1 is decided afresh (nothing of it went out)
    actions = feed(ctl, ev.Connected(0.01, 0.04, 0.3))
    assert actions and isinstance(actions[0], ev.SendRequest) and actions[0].chunk == 1
    assert ctl.finish(0.3).reconnects == 0   # a deliberate drop is no fault


# ------------------------------------------------------------------ beliefs
def test_a_decode_prior_stands_in_only_until_the_first_section_decodes() -> None:
    prior = decoding.DecodeCost(seconds_per_token=1e-3, bytes_per_token=1000.0)
    ctl = controller([[1_000_000]] * 3, beliefs=Beliefs(decode_prior=prior))
    feed(ctl, ev.Started(0.01, 0.04, 0.0))
    assert ctl._decode_cost() == decoding.measure(decoding.prior_sections(prior, 256, LAYERS))
    feed(ctl, ev.SectionHanded(0, 0, 250_000, 0.1), ev.SectionDecoded(0, 0, 250_000, 0.0025, 0.11))
    assert ctl._decode_cost() == decoding.measure([(256, 250_000, 0.0025)])


def test_the_partial_sample_is_the_recent_half_of_the_chunk_in_flight() -> None:
    """A chunk whose first 512 kB came at once (a shaper's full bucket) and whose next
    parts came at 25 MB/s is measured at 25 MB/s, not at its average so far: the decision
    taken at its last part sees that sample."""
    size = 12 * 128 * 1024 + 50_000   # the last part leaves less than a minimum sample to come
    ctl = controller([[size]] * 2, beliefs=Beliefs(prior_bps=1e9))
    feed(ctl, ev.Started(0.0, 0.0, 100.0), ev.AnswerBegan(0, size, 100.0))
    parts = [(100.001, 4 * 128 * 1024)] + [(100.001 + 128 * 1024 * k / 25e6, (4 + k) * 128 * 1024)
                                           for k in range(1, 9)]
    for at, count in parts:
        feed(ctl, ev.PartArrived(0, count, 0, at))
    decision = ctl.decisions[-1]
    assert decision.chunk == 1
    sample = decision.history[-1]
    assert sample.bytes / sample.busy_seconds == pytest.approx(25e6, rel=0.02)
    assert parts[-1][1] / (parts[-1][0] - 100.0) > 1.4 * 25e6   # what the average so far reads


# ------------------------------------------------------------------ replay
def test_a_recorded_input_sequence_replays_to_the_same_actions() -> None:
    ctl = controller([[1_000_000, 400_000]] * 3, policy="mpc", record=True)
    feed(ctl, ev.Started(0.01, 0.04, 0.0))
    t = 0.0
    for chunk in range(3):
        t += 0.05
        feed(ctl, *whole_answer(chunk, ctl.chunks[chunk].expected, t), *delivered(chunk, t + 0.01))
    assert ctl.done
    inputs = [item for item in ctl.log if not isinstance(item, (ev.SendRequest, ev.SendCancel, ev.Reconnect,
                                                                ev.ChunkFinished, ev.FailChunk, ev.Fail))]
    again = controller([[1_000_000, 400_000]] * 3, policy="mpc", record=True)
    feed(again, *inputs)
    assert again.log == ctl.log


@pytest.mark.parametrize("lower_bound", [True, False])
def test_a_lower_bound_alone_never_sends_the_first_chunk_to_text(lower_bound: bool) -> None:
    """A handshake that carried only the manifest reads a few kB in a few ms: as a prior
    it makes every chunk text, and text measures no link. Known to be a lower bound, it
    may pick a level but not text: the first chunk goes out at its smallest level. A
    caller's own prior is taken at its word."""
    ctl = controller([[1_000_000, 500_000, 200_000]] * 4, policy="mpc", slo=1.0, recompute_seconds_per_token=1e-4,
                     beliefs=Beliefs(prior_bps=50_000.0, prior_is_lower_bound=lower_bound))
    first = feed(ctl, ev.Started(0.004, 0.02, 0.0))[0]
    assert first == (ev.SendRequest(0, 2) if lower_bound else ev.SendRequest(0, TEXT))
    if lower_bound:
        assert "the link is not measured yet" in ctl.chunk_report(0).reason


def test_with_nothing_to_plan_on_the_next_chunk_waits_for_the_first_sample() -> None:
    """The first chunk probes a link known only by a lower bound; the next decision waits
    for that chunk's sample instead of deciding on the bound, which would send every chunk
    left to text at once (their token ids are tiny: each next request would go out at once)."""
    ctl = controller([[1_000_000, 500_000, 200_000]] * 4, policy="mpc", slo=1.0, recompute_seconds_per_token=1e-4,
                     beliefs=Beliefs(prior_bps=50_000.0, prior_is_lower_bound=True))
    assert feed(ctl, ev.Started(0.004, 0.02, 0.0)) == [ev.SendRequest(0, 2)]
    assert feed(ctl, ev.AnswerBegan(0, 200_000, 0.004), ev.PartArrived(0, 190_000, 3, 0.010)) == []
    actions = feed(ctl, ev.PartArrived(0, 200_000, 4, 0.012), ev.AnswerEnded(0, False, 0.012))
    requests = [a for a in actions if isinstance(a, ev.SendRequest)]
    assert requests and requests[0].chunk == 1 and requests[0].choice != TEXT   # 200 kB in 8 ms: a fast link


def test_a_predicted_continuation_asks_from_the_layer_its_prediction_restarts_at(monkeypatch) -> None:
    """As above, on a context whose levels predict each layer from the one before (layers
    0 and 2 coded alone, restart 2): three layers went out, so level 1 continues from
    layer 2 (decoded there, not delivered again), the estimate counts that layer's share,
    and the report's runs still split at the layers delivered. The cancel rule counts
    the same layers in what a continuation carries."""
    monkeypatch.setattr(controller_module.cancel, "reconsider", _switch_once(1))
    ctl = FetchController(dataclasses.replace(make_manifest([[1_000_000, 500_000]] * 2), restart=2),
                          FetchSettings(slo=10.0, policy="mpc"), context_id="ctx", beliefs=Beliefs(prior_bps=1e6))
    feed(ctl, ev.Started(0.01, 0.04, 0.0, continuations=True))
    assert feed(ctl, ev.AnswerBegan(0, 1_000_000, 0.01), ev.PartArrived(0, 300_000, 1, 0.2)) == [ev.SendCancel(0)]
    feed(ctl, *(e for layer in range(3) for e in (ev.SectionHanded(0, layer, 250_000, 0.3),
                                                   ev.LayerDelivering(0, layer, 0.31))),
         ev.PartArrived(0, 770_000, 3, 0.3))
    assert feed(ctl, ev.AnswerEnded(0, True, 0.35))[0] == ev.SendRequest(0, 1, first_layer=2)
    assert ctl.chunks[0].expected == ctl.manifest.answer_bytes(0, 1, 2)
    feed(ctl, ev.AnswerBegan(0, 251_000, 0.4), ev.PartArrived(0, 251_000, 4, 0.6), ev.AnswerEnded(0, False, 0.6),
         ev.LayerDelivering(0, 3, 0.62), ev.ChunkDone(0, 0.62))
    report = ctl.finish(0.7).chunks[0]
    assert report.level == 1 and report.layer_levels == [(0, 0), (3, 1)]
    assert cancel.InFlight(level=0, remaining_bytes=1, delivered_layers=3, layers=4, continuable=True,
                           restart=2).remaining_share == 0.5   # layers 2 and 3 travel
