"""The lane layout of versions 4 and 5 (FORMAT.md, "Rows and lanes"): the lane -> rows x tokens
map and the encoder's choice of lane shape, as pure functions."""
from __future__ import annotations

import numpy as np
import pytest

from codec import layer_codec
from codec.layer_codec import LANE_BITS, MAX_LANE_VALUES, LayerPlan


def _plan(kept: tuple[int, int], tokens: int, groups: tuple[int, int] = (0, 0)) -> LayerPlan:
    rows = sum(kept)
    return LayerPlan(kept=kept, steps=(1.0, 1.0), step=np.ones(rows, np.float32),
                     group=np.array([groups[0]] * kept[0] + [groups[1]] * kept[1], np.int32),
                     table=np.zeros((rows, 2), np.uint8), shift=np.zeros((rows, 2), np.uint8), tokens=tokens)


@pytest.mark.parametrize("kept,tokens,rows_per_lane,piece", [
    ((5, 3), 10, 1, 0), ((5, 3), 10, 2, 0), ((7, 0), 4, 3, 0), ((0, 4), 9, 1, 4), ((5, 3), 23, 1, 10),
    ((1, 1), 1, 1, 0), ((3, 2), 0, 2, 0),
])
def test_lanes_cover_every_value_once_in_format_order(kept, tokens, rows_per_lane, piece) -> None:
    plan = _plan(kept, tokens).with_lanes(rows_per_lane, piece)
    assert plan.shape_error() is None or tokens == 0
    spans = plan.spans()
    assert len(spans) == plan.lanes
    seen = np.zeros((plan.rows, tokens), np.int64)
    for r0, r1, t0, t1 in spans:
        assert r0 < r1 and (r1 <= kept[0] or r0 >= kept[0])  # never K and V together
        seen[r0:r1, t0:t1] += 1
        if plan.pieces > 1:
            assert r1 - r0 == 1 and t0 % piece == 0   # one row; a piece starts at its multiple
    assert (seen == 1).all()
    # K's lanes first; within K, piece by piece (neighbouring lanes: neighbouring rows)
    k_lanes = -(-kept[0] // rows_per_lane) * plan.pieces
    assert all(r0 < max(kept[0], 1) for r0, *_ in spans[:k_lanes])
    if plan.pieces > 1 and kept[0] > 1:
        assert spans[1][0] == spans[0][0] + 1 and spans[1][2] == spans[0][2]


def test_lane_count_formula() -> None:
    plan = _plan((100, 90), 1536)
    assert plan.with_lanes(3, 0).lanes == 34 + 30
    assert plan.with_lanes(1, 500).lanes == 190 * 4


@pytest.mark.parametrize("bits_per_value,tokens,groups,expect", [
    (5.0, 1536, (0, 0), (1, 512)),          # >= 2048 / 5 values per lane: rows cut in 3 pieces
    (5.0, 1536, (10, 0), (1, 520)),         # a multiple of the delta group: 520 + 520 + 496
    (5.0, 1536, (12, 16), (1, 528)),        # of both parts' groups (lcm 48)
    (3.0, 1536, (0, 0), (1, 768)),          # >= 683 values per lane: 2 pieces, not 3 of 512
    (5.0, 100, (0, 0), (5, 0)),             # short rows: 5 whole rows per lane (>= 410 values)
    (0.01, 1536, (0, 0), (10, 0)),          # few bits: lanes capped at 16383 values
    (0.001, 40000, (0, 0), (1, 13334)),     # long rows: at most 16383 values per lane
    (5.0, 1536, (1000, 0), (1, 1000)),      # a piece at least one delta group
    (5.0, 1536, (2000, 0), (1, 0)),         # a group past N: whole rows
])
def test_encoder_lane_shape(bits_per_value, tokens, groups, expect) -> None:
    plan = _plan((100, 90), tokens, groups)
    shaped = layer_codec.shape_lanes(plan, np.full(plan.rows, bits_per_value * tokens))
    assert (shaped.rows_per_lane, shaped.piece) == expect
    assert shaped.shape_error() is None
    values = plan.rows * tokens
    uncapped = bits_per_value * MAX_LANE_VALUES > LANE_BITS
    if uncapped and max(groups) < tokens // 2:  # lanes of about LANE_BITS to 2 * LANE_BITS ideal bits
        assert 0.95 * LANE_BITS <= values * bits_per_value / shaped.lanes <= 2 * LANE_BITS
    if shaped.piece:  # balanced: no stub of a last piece
        assert tokens - (shaped.pieces - 1) * shaped.piece > shaped.piece / 2


def test_rows_that_cannot_be_cut_are_not_codable() -> None:
    plan = _plan((2, 2), 40000, (20000, 0))
    with pytest.raises(layer_codec.RowsTooLong, match="40000 tokens"):
        layer_codec.shape_lanes(plan, np.full(plan.rows, 1e5))
