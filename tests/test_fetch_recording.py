"""``fetch.replay.recording``: what a recorded fetch's log says the world did, in the
order the controller was told it (the live replay is ``tests/test_fetch_replay.py``)."""
from __future__ import annotations

from streamer.fetch import events as ev
from streamer.fetch.links import BEGIN, PARTIAL, POINT
from streamer.fetch.replay import recording


def _log_with_a_read_before_its_answer_began() -> list:
    """Chunk 0 arrives whole; then one socket read carries chunk 1's CHUNK_BEGIN and its
    first 32 KiB. The driver reports the read (Activity) before the frames parsed from it,
    so the controller took those bytes as chunk 1's before its AnswerBegan."""
    return [ev.Started(0.01, 0.02, 100.0, continuations=True),
            ev.SendRequest(0, 2, 0),
            ev.SendRequest(1, 2, 0),
            ev.AnswerBegan(0, 1000, 100.010),
            ev.PartArrived(0, 1000, 8, 100.020),
            ev.AnswerEnded(0, False, 100.020),
            ev.ChunkFinished(0),
            ev.Activity(100.031, partial=32768),
            ev.AnswerBegan(1, 500000, 100.030),
            ev.Activity(100.040, partial=49152),
            ev.PartArrived(1, 61946, 1, 100.050)]


def test_a_read_between_answers_counts_for_the_answer_it_began() -> None:
    """A read reported between two answers is the next answer's: its bytes go to that
    answer's timeline ahead of its begin, as the controller saw them. Dropped (the replay
    did so while no answer had begun), the replayed controller's arrival marks for the
    chunk lacked a point, a cancel rule judging the chunk by its recent arrivals measured
    another rate, and a real fetch replayed to other requests."""
    world = recording(_log_with_a_read_before_its_answer_began())
    second = world.answers[1]
    assert second.chunk == 1
    kinds = [(e.kind, e.received) for e in second.events]
    assert kinds[:3] == [(PARTIAL, 32768), (BEGIN, 0), (PARTIAL, 49152)]
    assert kinds[3][0] == POINT and kinds[3][1] == 61946
    assert all(e.kind != PARTIAL for e in world.answers[0].events)



def test_a_read_handled_after_later_items_is_replayed_after_them_with_its_own_stamp() -> None:
    """The driver handles a read after what was already on its queue: here chunk 1's
    begin, read at 100.030, reached the controller after a decoder report and a timer
    wake-up stamped 100.034 and 100.035, and the controller decided on chunk 2 knowing
    both. The replay hands it over just after them (ordered by time, it would come
    first and the decision would be taken on less), told as read at 100.030."""
    log = _log_with_a_read_before_its_answer_began()[:7] + [
        ev.SectionDecoded(0, 7, 120, 0.002, 100.034),
        ev.Tick(100.035),
        ev.AnswerBegan(1, 500000, 100.030),
        ev.PartArrived(1, 61946, 1, 100.050)]
    world = recording(log)
    begin, point = world.answers[1].events
    assert len(world.wakes) == 1 and abs(world.wakes[0] - 0.035) < 1e-9
    assert begin.kind == BEGIN and begin.at > world.wakes[0] and abs(begin.happened - 0.030) < 1e-9
    assert point.kind == POINT and abs(point.at - 0.050) < 1e-9 and point.stamp is None
