"""Transport (internal): listening, dialing, keepalive, pre-auth bounds,
interface addresses and the in-memory network; nothing here is public API."""
