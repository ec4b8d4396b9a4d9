"""Memory measurement: a probe that wraps each stage, a live-tensor tracker, and the report."""
