"""Adaptation, pure: which quality level (or text recompute) each chunk gets.

* ``estimator`` - throughput from receiver-side observations (no clocks)
* ``base``      - ``PlanInput`` / ``Observation`` / ``Choice`` and helpers every policy uses
* ``mpc``, ``greedy``, ``fixed``, ``text`` - one policy each; ``policies`` names them
* ``plan``      - the exact deadline DP over all remaining chunks
* ``decide``    - one decision from a manifest, shared by ``StreamSession`` and the simulator
* ``simulate``  - socket-free fetches over traces, and the oracle
"""
