"""``kvwire bench serve --quick``: the real server, a real sender behind the shaping proxy,
content-addressed prefixes in a file store, SmolLM2. Figures are not asserted (no timing
thresholds); what must hold whatever the machine's speed is."""
from __future__ import annotations

import asyncio

import pytest

import codec
from streamer.tools import bench_serve
from streamer.tools.demo_llm import PROFILE

pytestmark = pytest.mark.slow


def test_quick_bench_fetches_every_stored_prefix_and_shares_concurrent_fetches(smollm2) -> None:
    cfg = bench_serve.QUICK
    out = asyncio.run(bench_serve.run(cfg, say=lambda *a: None, loaded=smollm2))
    assert [(r["tokens"], r["rate_mbit"]) for r in out["rows"]] == [(n, rate) for rate in cfg.rates_mbit
                                                                     for n in cfg.sizes]
    for row in out["rows"]:
        for prompt in row["prompts"]:
            # the whole stored prefix came from the sender, as KV or as text the server recomputed
            assert prompt["prefix"] == "fetched"
            assert len(prompt["levels"]) == row["tokens"] // cfg.chunk_tokens
        assert row["full_seconds"]["warm"] > 0 and row["fetched_seconds"]["warm"] > 0
    concurrent = out["concurrent"]
    assert concurrent["errors"] == [] and concurrent["answered"] == cfg.concurrent
    assert concurrent["fetches"] == 2
    assert sorted(r["how"] for r in concurrent["per_request"]) == ["fetched"] * 2 + ["joined"] * (cfg.concurrent - 2)
    # the exact level answers as full prefill does (only the prefill's split differs); every
    # stored level is tried: the exact one, then the profile's
    by_level = concurrent["by_level"]
    assert [r["level"] for r in by_level] == list(range(1 + len(codec.Profile.load(PROFILE).levels)))
    assert by_level[0]["correct"] == cfg.concurrent and by_level[0]["parted"] == []
    assert {t["target"].split(":")[0] for t in out["targets"]}   # every target is reported
    assert "| stored tokens |" in bench_serve.render(out)
