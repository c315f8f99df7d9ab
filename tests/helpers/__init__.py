"""What the tests share: the process harness, the cases and the per-rank workers they spawn, launched scripts."""
