"""The exchanges that let each rank's decoder layers see the whole sequence for a share of the heads."""

from .heads import kv_replication
from .ulysses import ulysses_attention

__all__ = ["kv_replication", "ulysses_attention"]
