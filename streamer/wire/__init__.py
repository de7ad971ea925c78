"""The kvwire wire protocol, sans I/O (h11 style): bytes in, events out.

* ``events``   - one frozen dataclass per frame, and the protocol's error types
* ``frames``   - the byte layout of frames and their JSON schemas
* ``protocol`` - ``Connection``: the state machine both ends drive with bytes alone
* ``auth``     - the HMAC challenge-response of the handshake
* ``manifest`` - the stored description of a context (chunks, sizes per level)
"""
