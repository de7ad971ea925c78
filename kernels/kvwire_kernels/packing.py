"""One buffer and one launch per group of layers: the group's lane arrays and its section table.

The lane kernel (``rans_decode_group``) decodes every coded section of a group in one
launch (issue #16): its grid covers all the group's lanes, and a table of sections,
packed at the head of the group's buffer, says where each section's arrays are, where its
coefficients go and which of the launch's lanes are its own. Packed into one page-locked
buffer, the whole group goes to the device in one copy (not 8 small uploads per section)
and the kernel gets the buffer's address. Pure numpy, so the layout is tested without a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from codec import layer_codec

#: every array starts at a multiple of this (the widest element, i64, and a cache line half)
ALIGN = 16
#: rans_decode.cu's SectionEntry: 32-bit byte offsets in the buffer, the coefficients'
#: offset in floats, the launch's first lane of the section and its plan
SECTION_ENTRY = np.dtype([("words", "<u4"), ("lane_start", "<u4"), ("states", "<u4"), ("rows", "<u4"),
                          ("out", "<u4"), ("first_lane", "<i4"), ("lanes", "<i4"), ("kept_k", "<i4"),
                          ("rows_per_lane", "<i4"), ("piece", "<i4"), ("n_rows", "<i4"), ("pad", "<i4")])
#: rans_decode.cu's RowCoding: step, delta group, and tables | shifts << 16 (anchor, delta)
ROW_CODING = np.dtype([("step", "<f4"), ("group", "<i4"), ("coding", "<u4")])
#: the arrays of one section, in buffer order
FIELDS = ("words", "lane_start", "states", "rows")
#: offsets are 32-bit: a group's buffer and its coefficients stay below this
LIMIT = 1 << 31


@dataclass(frozen=True)
class LayerLayout:
    """One packed section: its arrays' byte offsets, its lanes among the launch's, and
    where its [tokens, rows] float32 coefficients are in the launch's output."""

    layer: int
    offsets: dict[str, int]
    first_lane: int
    lanes: int
    out: int
    shape: tuple[int, int]

    def coefficients(self, out):
        """This section's [tokens, rows] view of its launch's flat coefficients (a torch
        tensor or a numpy array)."""
        return out[self.out:self.out + self.shape[0] * self.shape[1]].reshape(self.shape)

    def statuses(self, status):
        """This section's lanes of its launch's lane statuses."""
        return status[self.first_lane:self.first_lane + self.lanes]


@dataclass(frozen=True)
class GroupLayout:
    """A packed group: the section table at byte 0, then each section's arrays."""

    layers: tuple[LayerLayout, ...]
    lanes: int        # threads of the launch
    out_floats: int   # float32 coefficients of the launch
    used: int         # bytes of the buffer


def _rows(plan: layer_codec.LayerPlan) -> np.ndarray:
    table, shift = np.asarray(plan.table, np.uint32), np.asarray(plan.shift, np.uint32)
    rows = np.empty(plan.rows, ROW_CODING)
    rows["step"], rows["group"] = plan.step, plan.group
    rows["coding"] = table[:, 0] | table[:, 1] << 8 | shift[:, 0] << 16 | shift[:, 1] << 24
    return rows


def _arrays(lanes: layer_codec.LanePayload) -> dict[str, np.ndarray]:
    if lanes.lane_start.size and int(lanes.lane_start[-1]) >= LIMIT:
        raise ValueError("a section's words do not fit the kernel's 32-bit word offsets")
    values = {"words": np.ascontiguousarray(lanes.words, np.uint16),
              "lane_start": np.ascontiguousarray(lanes.lane_start, np.int32),
              "states": np.ascontiguousarray(lanes.states, np.uint32), "rows": _rows(lanes.plan)}
    return {name: values[name] for name in FIELDS}


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def group_size(sections: list[tuple[int, layer_codec.LanePayload]]) -> int:
    """Bytes :func:`pack` needs for these (layer, lanes)."""
    return _align(len(sections) * SECTION_ENTRY.itemsize) + sum(
        _align(array.nbytes) for _, lanes in sections for array in _arrays(lanes).values())


def pack(sections: list[tuple[int, layer_codec.LanePayload]], into: np.ndarray, tokens: int) -> GroupLayout:
    """Write the section table and each (layer, lanes)'s arrays into ``into`` (uint8, at
    least :func:`group_size` bytes) for one launch over ``tokens`` coded tokens."""
    table = np.zeros(len(sections), SECTION_ENTRY)
    layouts, at, lane, out = [], _align(table.nbytes), 0, 0
    for i, (layer, lanes) in enumerate(sections):
        offsets = {}
        for name, array in _arrays(lanes).items():
            raw = array.reshape(-1).view(np.uint8)
            into[at:at + raw.size] = raw
            offsets[name] = at
            at += _align(raw.size)
        plan = lanes.plan
        table[i] = (*(offsets[name] for name in FIELDS), out, lane, plan.lanes, plan.kept[0], plan.rows_per_lane,
                    plan.piece_tokens, plan.rows, 0)
        layouts.append(LayerLayout(layer, offsets, lane, plan.lanes, out, (tokens, plan.rows)))
        lane, out = lane + plan.lanes, out + tokens * plan.rows
    if at >= LIMIT or out >= LIMIT:
        raise ValueError(f"a group of {len(sections)} sections is too large for one launch's 32-bit offsets")
    into[:table.nbytes] = table.view(np.uint8)
    return GroupLayout(tuple(layouts), lane, out, at)


def view(buffer: np.ndarray, layout: LayerLayout, lanes: layer_codec.LanePayload) -> dict[str, np.ndarray]:
    """The arrays of one packed section read back from ``buffer`` (what the kernel sees)."""
    out = {}
    for name, array in _arrays(lanes).items():
        start = layout.offsets[name]
        out[name] = buffer[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
    return out


def table(buffer: np.ndarray, group: GroupLayout) -> np.ndarray:
    """The section table read back from ``buffer``."""
    return buffer[:len(group.layers) * SECTION_ENTRY.itemsize].view(SECTION_ENTRY)
