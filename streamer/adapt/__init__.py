"""Adaptation, pure: which quality level (or text recompute) each chunk gets.

* ``estimator`` - throughput from receiver-side observations (no clocks)
* ``base``      - ``PlanInput`` / ``Observation`` / ``Choice`` and helpers every policy uses
* ``mpc``, ``greedy``, ``fixed``, ``text`` - one policy each; ``policies`` names them
* ``plan``      - the exact deadline DP over all remaining chunks
* ``decide``    - one decision from a manifest (``streamer.fetch``'s controller calls it)
* ``cancel``    - whether to give up the chunk in flight for a cheaper answer
* ``decoding``, ``recompute``, ``overlap`` - the receiver's decode and recompute costs, and
  how recompute overlaps the transfers
"""
