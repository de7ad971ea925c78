"""Shared pytest configuration."""
from __future__ import annotations

import pytest


# ---- netsim: run @pytest.mark.netns tests only where namespaces can be built ----
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("netns") is not None:
        from netsim.netns import netns_available

        ok, reason = netns_available()
        if not ok:
            pytest.skip(f"netns unavailable: {reason}")
