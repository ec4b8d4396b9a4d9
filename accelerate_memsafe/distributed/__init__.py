"""Plain functions for distributed work: sharding, scatter from rank 0, buffer sync, timeouts."""
