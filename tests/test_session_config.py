"""SessionConfig: one validated object for how a StreamSession fetches."""
from __future__ import annotations

import dataclasses

import pytest

import streamer
from streamer.net.config import SessionConfig
from streamer.receiver import ReceiverConfig


@pytest.mark.parametrize("field, value, error", [
    ("slo", 0, ValueError), ("slo", float("nan"), ValueError), ("policy", "bogus", ValueError),
    ("device", "tpu", ValueError), ("device", "not a device", ValueError),
    ("recompute_seconds_per_token", -1e-4, ValueError), ("recompute_seconds_per_token", 0.0, ValueError),
    ("recompute_context_seconds", -1e-9, ValueError), ("recompute_overlaps", 1, TypeError),
    ("prior_bps", 0.0, ValueError),
    ("decode_prior", 2e-5, TypeError),
    ("connect_timeout", 0, ValueError), ("stall_timeout", -1, ValueError),
    ("max_reconnects", -1, ValueError), ("max_reconnects", 1.5, ValueError),
    ("backoff", 0, ValueError), ("max_buffered_bytes", 0, ValueError), ("max_frame", 10, ValueError),
    ("ssl", "yes", TypeError), ("auth_token", "short", ValueError), ("server_hostname", 3, TypeError),
])
def test_invalid_values_are_refused_at_construction(field, value, error) -> None:
    with pytest.raises(error):
        SessionConfig(**{field: value})


def test_the_session_takes_a_config_and_keyword_overrides() -> None:
    base = SessionConfig(slo=3.0, policy="greedy", stall_timeout=7.0)
    session = streamer.StreamSession("127.0.0.1", 1, "ctx", config=base, slo=0.5)
    assert session.config == dataclasses.replace(base, slo=0.5)
    assert (session.slo, session.policy_name) == (0.5, "greedy")
    assert base.slo == 3.0   # the caller's config is not touched


def test_keyword_arguments_alone_still_build_a_config() -> None:
    session = streamer.StreamSession("127.0.0.1", 1, "ctx", slo=2.0, max_reconnects=0)
    assert session.config == SessionConfig(slo=2.0, max_reconnects=0)
    with pytest.raises(TypeError):
        streamer.StreamSession("127.0.0.1", 1, "ctx", no_such_option=1)
    with pytest.raises(ValueError, match="slo"):
        streamer.StreamSession("127.0.0.1", 1, "ctx", slo=-1)


def test_the_receiver_config_shares_the_session_config() -> None:
    config = ReceiverConfig(servers=[("h", 1)], session=SessionConfig(stall_timeout=9.0), slo=0.25)
    # no context larger than the cache is fetched, unless the session config says otherwise
    assert config.session == SessionConfig(stall_timeout=9.0, slo=0.25, max_context_bytes=config.cache_bytes)
    assert ReceiverConfig(servers=[("h", 1)], session=SessionConfig(max_context_bytes=5)).session.max_context_bytes == 5
    assert config.slo == 0.25 and config.policy == "mpc" and config.device == "cpu"
    with pytest.raises(ValueError):
        ReceiverConfig(servers=[("h", 1)], policy="bogus")
