"""KV transfer between engines: the connector interface the scheduler calls (``base``)."""
