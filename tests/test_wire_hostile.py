"""Hostile continuations and lookups (``kvwire bench adversarial wire``'s inputs): a sender
refuses a first layer past the context's layers with a non-fatal ERROR "bad_request" (the
same connection then serves a chunk) and a first layer the protocol forbids with a fatal
ERROR "protocol", and stays up; a receiver refuses a sender's answer to a continuation
that does not repeat its first layer, claims more than the whole blob, or whose header
does not add up. A sender ends the connection on a LOOKUP that is malformed, too long,
over the control limit, on version 2 or before authentication, and stays up; a receiver
refuses a PREFIX that answers no LOOKUP or claims what the lookup did not ask. Their
seconds and peak RSS are what the bench reports; they are not asserted here."""
from __future__ import annotations

import json
import re

import pytest

from streamer.tools import adversarial, adversarial_wire
from streamer.tools.cli import main

EXPECTED = {
    "continuation_first_layer_past_the_layers": f"ERROR bad_request: first layer {adversarial_wire.LAYERS} out of range",
    "continuation_first_layer_65534": "ERROR bad_request: first layer 65534 out of range",
    "continuation_first_layer_65535": "fatal ERROR protocol: malformed REQUEST frame: REQUEST.first_layer: 65535",
    "continuation_first_layer_0_written_out": "fatal ERROR protocol: malformed REQUEST frame: REQUEST.first_layer: 0",
    "continuation_of_text": "fatal ERROR protocol: REQUEST for chunk 0 as text from layer 1: text has no layers",
    "continuation_on_version_1": "fatal ERROR protocol: REQUEST for chunk 0 from layer 1 on a version 1 connection",
    "answer_chunk_begin_without_first_layer": "RemoteProtocolError: CHUNK_BEGIN for chunk 0 level 0 does not answer",
    "answer_continuation_of_2^40_bytes": "ValueError: a continuation of chunk 0 at level 0 of 1099511627776 bytes",
    "answer_continuation_header_disagreeing": "CorruptBitstream: chunk header says a ",
    "lookup_chain_of_513_hashes": "fatal ERROR protocol: malformed LOOKUP frame: LOOKUP.chain: expected 1..512 hashes, "
                                  "got 513",
    "lookup_chain_empty": "fatal ERROR protocol: malformed LOOKUP frame: LOOKUP.chain: expected 1..512 hashes, got 0",
    "lookup_chain_uppercase_hex": "fatal ERROR protocol: malformed LOOKUP frame: LOOKUP.chain: hash 0: expected 64 "
                                  "lowercase hex",
    "lookup_malformed_json": "fatal ERROR protocol: malformed LOOKUP frame: bad JSON",
    "lookup_over_the_control_limit": "fatal ERROR protocol: LOOKUP frame announces 65537 payload bytes (limit 65536)",
    "lookup_on_version_2": "fatal ERROR protocol: LOOKUP on a version 2 connection: lookups need version 3",
    "lookup_before_auth": "fatal ERROR auth: authentication required: LOOKUP received before AUTH",
    "answer_prefix_to_no_lookup": "RemoteProtocolError: PREFIX with no outstanding request",
    "answer_prefix_longer_than_the_chain": "RemoteProtocolError: PREFIX claims 3 chunks of a LOOKUP of 2 hashes",
    "answer_prefix_of_no_context_with_chunks": "RemoteProtocolError: malformed PREFIX frame: PREFIX: context_id must be "
                                               "null exactly when chunks is 0",
}
#: inputs whose row reports a measurement, not a refusal (each has its own test)
MEASURED = {"continuation_of_the_last_layer_repeated", "lookup_of_512_hashes_repeated"}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_hostile_continuation_is_a_typed_refusal(name: str) -> None:
    row = adversarial.run_one(name)
    assert row["error"].startswith(EXPECTED[name]), row
    if name in adversarial_wire.SENDER_SIDE:
        assert row["daemon_up"], row
    if "bad_request" in EXPECTED[name]:
        assert row["error"].endswith("; the connection then served chunk 0"), row


def test_every_input_has_its_expectation() -> None:
    assert set(EXPECTED) | MEASURED == set(adversarial_wire.NAMES)


def test_repeated_last_layer_continuations_are_answered_with_a_layer_each() -> None:
    row = adversarial.run_one("continuation_of_the_last_layer_repeated")
    found = re.fullmatch(r"(\d+) answers of (\d+) bytes for (\d+) bytes of blobs read from the store "
                         r"\((\d+\.\d)x what was sent; (\d+) layers\)", row["error"])
    assert found, row
    answers, sent, read, _, layers = (float(g) for g in found.groups())
    assert answers == adversarial_wire.REPEATS and layers == adversarial_wire.LAYERS
    assert 1 < read / sent < layers   # a header and one section out of the layers' blob
    assert row["daemon_up"], row


def test_the_largest_lookups_are_answered_one_by_one() -> None:
    row = adversarial.run_one("lookup_of_512_hashes_repeated")
    found = re.fullmatch(r"(\d+) lookups of (\d+) hashes \((\d+) bytes each\) answered in (\d+\.\d+) s, "
                         r"matching \[(\d+)\] chunks", row["error"])
    assert found, row
    lookups, hashes, size, _, matched = found.groups()
    assert int(lookups) == adversarial_wire.REPEATS and int(hashes) == 512
    assert int(size) < 64 * 1024 and int(matched) == adversarial_wire.CHUNKS
    assert row["daemon_up"], row


@pytest.mark.slow
def test_the_bench_reports_a_row_per_input(capsys) -> None:
    assert main(["bench", "adversarial", "wire", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["wire"]
    assert [row["input"] for row in rows] == list(adversarial_wire.NAMES)
    assert all(row["error"] and row["seconds"] is not None for row in rows), rows
