"""asyncio adapters around the pure cores: the sender daemon (``sender``), the client
connection (``client``), ``StreamSession`` (``session``) with its ``SessionConfig``
(``config``), ordered delivery and decode (``delivery``, ``devices``), TLS (``tls``),
fetch reports (``report``) and the sender's metrics (``sender_metrics``)."""
