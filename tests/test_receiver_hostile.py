"""Hostile HTTP requests to a live receiver daemon (``kvwire bench adversarial http``'s
inputs, #15): each is refused with a typed 4xx that names the cause, and the daemon
then still answers. Their seconds and peak RSS are what the bench reports; they are
not asserted here."""
from __future__ import annotations

import pytest

from streamer.tools import adversarial, adversarial_http

#: inputs that take seconds to build or to play out
_SLOW = {"http_gzip_body_32MiB_of_zeros", "http_chunked_body_16MiB", "slowloris"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in _SLOW else n
                                  for n in adversarial_http.NAMES])
def test_each_hostile_request_is_a_typed_4xx_and_the_daemon_stays_up(name: str) -> None:
    row = adversarial.run_one(name)
    assert row["daemon_up"], row
    if name == "slowloris":
        n = adversarial_http.SLOWLORIS_CONNECTIONS
        assert row["error"].startswith(f"{n} of {n} partial heads closed by the daemon"), row
    else:
        assert row["error"].startswith(("HTTP 400", "HTTP 413")), row
