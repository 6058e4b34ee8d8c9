"""Bytes of uploaded LoRA tensors a peer holds, per uploader and in all (LimitsConfig.adapter_bytes_per_client and
adapter_bytes). peers/lora.py's AdapterCache (fine-tuning copies) and peers/served_adapters.py (published served
adapters) charge one AdapterBudget, so that together they stay within what the operator gave them. A refusal is
LimitExceeded (RESOURCE_EXHAUSTED on the wire) naming the limit. The operator's own `--adapters` are not charged.
"""

from __future__ import annotations

import threading
from collections import Counter

from swarm.errors import LimitExceeded

PER_CLIENT = "adapter_bytes_per_client"
TOTAL = "adapter_bytes"


class AdapterBudget:
    """Thread-safe byte counts by uploader (peers/limits.py uploader_key)."""

    def __init__(self, per_client: int, total: int) -> None:
        self.per_client, self.total = per_client, total
        self._held: Counter[str] = Counter()
        self._lock = threading.Lock()

    def held(self, owner: str) -> int:
        with self._lock:
            return self._held[owner]

    @property
    def total_held(self) -> int:
        with self._lock:
            return sum(self._held.values())

    def shortfall(self, owner: str, nbytes: int, freeing: int = 0) -> str | None:
        """The limit that `owner` taking `nbytes` more (and giving back `freeing`) would pass; None if it fits."""
        with self._lock:
            return self._shortfall(owner, nbytes - freeing)

    def take(self, owner: str, nbytes: int, freeing: int = 0) -> None:
        """Charge `nbytes` to `owner`, giving back `freeing` (an upload it replaces) in the same step.

        Raises:
            LimitExceeded: "adapter_bytes_per_client" or "adapter_bytes", with the sizes.
        """
        with self._lock:
            limit = self._shortfall(owner, nbytes - freeing)
            if limit is not None:
                held = self._held[owner] if limit == PER_CLIENT else sum(self._held.values())
                allowed = self.per_client if limit == PER_CLIENT else self.total
                whose = "this client's uploads hold" if limit == PER_CLIENT else "uploads of all clients hold"
                raise LimitExceeded(
                    limit, f"an adapter upload of {nbytes} bytes; {whose} {held - freeing} of {allowed} bytes"
                )
            self._held[owner] += nbytes - freeing
            if self._held[owner] <= 0:
                del self._held[owner]

    def give_back(self, owner: str, nbytes: int) -> None:
        with self._lock:
            self._held[owner] -= nbytes
            if self._held[owner] <= 0:
                del self._held[owner]

    def _shortfall(self, owner: str, more: int) -> str | None:
        if self._held[owner] + more > self.per_client:
            return PER_CLIENT
        if sum(self._held.values()) + more > self.total:
            return TOTAL
        return None
