"""The fetch, pure: one controller that owns every decision of a fetch, and the drivers' shared vocabulary.

* ``events``     - what a driver feeds the controller (timestamped) and the actions it gets back
* ``controller`` - ``FetchController``: per-chunk state, throughput and cost beliefs, the
  policy's decisions, the cancel rule, refetches and reconnects; reads no clock
* ``report``     - ``FetchReport`` / ``ChunkReport``, the record of a fetch
* ``simulate``   - the virtual-clock driver: a link model, a delivery model and the same controller
* ``links``      - the simulator's link models (a bandwidth trace, or a recorded arrival timeline)
* ``oracle``     - the best schedule in hindsight, a lower bound on every policy

``streamer.net.session.StreamSession`` is the other driver: sockets and decode threads
in, the same actions out.
"""
