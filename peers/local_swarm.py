"""The embedded default: a local Ray bound to 127.0.0.1, a DHT bootstrap node and N peers covering the model
(N = 0: just Ray and the DHT, for peers that join later), all with the same swarm credentials (a member's, or
explicitly open). Used by `swarm up` and `swarm demo`; on the head node of
a Ray cluster (cluster/), `swarm up --ray-address` attaches to that cluster instead of starting one, and the DHT
address is published in Ray for the workers' `swarm peer join`."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

from peers.config import PeerConfig, ServerConfig
from peers.daemon import PeerDaemon, drain
from peers.launch import publish_initial_peers
from swarm.partition import open_checkpoint
from swarm.ray_cluster import connect_ray
from swarm.registry import Registry
from swarm.registry.hosts import HostConfig
from swarm.security import SwarmCredentials


class LocalSwarm:
    def __init__(
        self,
        model_path: str | Path,
        num_peers: int,
        credentials: SwarmCredentials,
        ttl_s: float = 30.0,
        cache_tokens: int = 65536,
        dht_port: int = 0,
        ray_address: str | None = None,
        host: HostConfig | None = None,
    ) -> None:
        host = host or HostConfig()  # 127.0.0.1
        num_blocks = open_checkpoint(model_path)[2].num_layers
        if not 0 <= num_peers <= num_blocks:
            raise ValueError(f"the number of peers must be between 0 and {num_blocks}, got {num_peers}")
        connect_ray(ray_address)
        self.bootstrap = Registry(
            host=host.host, port=dht_port, announce_host=host.announce_host, credentials=credentials
        )
        self.initial_peers = tuple(self.bootstrap.addresses)
        publish_initial_peers(self.initial_peers)
        self.config = PeerConfig(
            model_path=str(model_path),
            initial_peers=self.initial_peers,
            host=host.host,
            announce_host=host.announce_host,
            ttl_s=ttl_s,
            announce_period_s=ttl_s / 3,
            server=ServerConfig(
                host=host.host, announce_host=host.announce_host, cache_tokens=cache_tokens, credentials=credentials
            ),
        )
        bounds = [round(i * num_blocks / num_peers) for i in range(num_peers + 1)] if num_peers else []
        self.daemons = [
            PeerDaemon(dataclasses.replace(self.config, blocks=span), self.bootstrap)
            for span in itertools.pairwise(bounds)
        ]

    @property
    def ray_address(self) -> str:
        import ray

        return ray.get_runtime_context().gcs_address

    def start(self) -> list[dict]:
        """Start every peer (loading in parallel) and wait until all serve; returns their infos."""
        for daemon in self.daemons:
            daemon.launch()
        return [daemon.wait_serving() for daemon in self.daemons]

    def alive(self) -> bool:
        return all(daemon.alive() for daemon in self.daemons)

    def stop(self) -> bool:
        """Drain every peer and shut the DHT node down; True if all in-flight work finished."""
        try:
            return drain(self.daemons, timeout_s=self.config.drain_grace_s + 30)
        finally:
            self.bootstrap.shutdown()
