"""One buffer per group of layers: the lane arrays of each layer at aligned offsets.

The lane kernel reads, per layer, the words, lane starts and final states of the
section and the plan's per-row step, delta group, table and shift. Copying each of
those as its own transfer cost 8 small pinned uploads per section (issue #16); packed
into one page-locked buffer, a whole group of layers goes to the device in one copy
and the kernel gets pointers into it. Pure numpy, so the layout is tested without a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from codec import layer_codec

#: every array starts at a multiple of this (the widest element, i64, and a cache line half)
ALIGN = 16
#: the arrays of one layer, in buffer order, with the dtype the kernel reads them as
FIELDS = (("words", np.uint16), ("lane_start", np.int64), ("states", np.uint32), ("step", np.float32),
          ("group", np.int32), ("table", np.uint8), ("shift", np.uint8))


@dataclass(frozen=True)
class LayerLayout:
    """Byte offsets of one layer's arrays in its group's buffer."""

    layer: int
    offsets: dict[str, int]


def _arrays(lanes: layer_codec.LanePayload) -> dict[str, np.ndarray]:
    plan = lanes.plan
    values = {"words": lanes.words, "lane_start": lanes.lane_start, "states": lanes.states, "step": plan.step,
              "group": plan.group, "table": plan.table, "shift": plan.shift}
    return {name: np.ascontiguousarray(values[name], dtype=dtype) for name, dtype in FIELDS}


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def group_size(sections: list[tuple[int, layer_codec.LanePayload]]) -> int:
    """Bytes :func:`pack` needs for these (layer, lanes)."""
    return sum(_align(array.nbytes) for _, lanes in sections for array in _arrays(lanes).values())


def pack(sections: list[tuple[int, layer_codec.LanePayload]], into: np.ndarray) -> tuple[list[LayerLayout], int]:
    """Copy each (layer, lanes)'s arrays into ``into`` (uint8, at least :func:`group_size`
    bytes); their layouts and the bytes used."""
    layouts, at = [], 0
    for layer, lanes in sections:
        offsets = {}
        for name, array in _arrays(lanes).items():
            raw = array.reshape(-1).view(np.uint8)
            into[at:at + raw.size] = raw
            offsets[name] = at
            at += _align(raw.size)
        layouts.append(LayerLayout(layer, offsets))
    return layouts, at


def view(buffer: np.ndarray, layout: LayerLayout, lanes: layer_codec.LanePayload) -> dict[str, np.ndarray]:
    """The arrays of one packed layer read back from ``buffer`` (what the kernel sees)."""
    shapes = {name: array.shape for name, array in _arrays(lanes).items()}
    out = {}
    for name, dtype in FIELDS:
        count = int(np.prod(shapes[name]))
        start = layout.offsets[name]
        out[name] = buffer[start:start + count * np.dtype(dtype).itemsize].view(dtype).reshape(shapes[name])
    return out
