"""A peer's rebalancing loop: on a randomized period, read the registry and ask peers/placement.py whether this
peer should serve other blocks; if so, have the daemon move (drain, load the new span, announce it).

Started by PeerDaemon.wait_serving when PeerConfig.rebalances; stopped before the daemon drains.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable

from peers.config import PlacementConfig
from peers.placement import BlockLoad, plan_move
from swarm.registry import Registry
from swarm.types import PeerInfo, Span

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 600.0  # stop() waits this long for a move in progress (drain grace + loading the new span)
MAX_CONFIRM_DELAY_S = 10.0


class Rebalancer:
    """Checks every rebalance_period_s x U(0.5, 1.5): the random spread keeps peers that share a view from all
    checking at once; a planned move is confirmed on a second registry read before it is made."""

    def __init__(
        self,
        registry: Registry,
        model: str,
        total_blocks: int,
        describe: Callable[[], PeerInfo],
        move: Callable[[Span], None],
        config: PlacementConfig,
        rng: random.Random | None = None,
    ) -> None:
        self.registry, self.model, self.total_blocks = registry, model, total_blocks
        self.describe, self.move, self.config = describe, move, config
        self.rng = rng or random.Random()
        self.moves = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rebalancer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """No further checks; waits for a move in progress to finish."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(STOP_TIMEOUT_S)

    def target(self) -> Span | None:
        """Where this peer should move now, on a fresh registry read (its own record as it is this moment)."""
        me = self.describe()
        peers = [p for p in self.registry.peers(self.model) if p.peer_id != me.peer_id]
        load = BlockLoad.from_peers([*peers, me], self.total_blocks)
        return plan_move(load, me, self.config.rebalance_margin)

    def check(self) -> Span | None:
        """Move if the plan still holds after a short random pause; returns the new span, or None to stay.

        The pause keeps two peers from making the same move at once: the one that confirms second sees the first
        one's claim (a JOINING record on the new span, announced before it drains) and stays.
        """
        planned = self.target()
        if planned is None:
            return None
        if self._stop.wait(self.rng.uniform(0.0, min(self.config.rebalance_period_s / 4, MAX_CONFIRM_DELAY_S))):
            return None
        if self.target() != planned:
            return None
        self.move(planned)
        self.moves += 1
        return planned

    def _run(self) -> None:
        while not self._stop.wait(self.config.rebalance_period_s * self.rng.uniform(0.5, 1.5)):
            try:
                self.check()
            except Exception:  # a DHT hiccup or a failed move must not end the loop; the next period retries
                logger.exception("rebalance check failed")
