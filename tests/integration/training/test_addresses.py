"""Training stages, a trainer and DHT nodes bind and announce the addresses they are told (issue 15, item 1), on
loopback addresses other than 127.0.0.1 (every 127.x address is loopback on Linux): stage 0-2 binds and announces
127.0.0.2; stage 2-4 binds every interface and announces 127.0.0.3; the trainer, binding 127.0.0.4, finds both
through the DHT and trains through them. A node announcing an address it cannot connect to warns at start. A job
on Ray announces what its config says.
"""

from __future__ import annotations

import dataclasses
import logging
import socket

import pytest

from peers.training.actor import TrainingStagePeer
from peers.training.job import TrainingJob
from swarm.registry import Registry
from swarm.training.trainer import Trainer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def swarm(make_config):
    config = make_config("addresses", codec="NONE", micro_batch=4, target_batch=4, steps=1, inflight=1)
    bootstrap = Registry(host="127.0.0.2", credentials=config.credentials)
    peers = bootstrap.addresses
    stages = [
        TrainingStagePeer(dataclasses.replace(config, host="127.0.0.2"), 0, 2, peers, "s0"),
        TrainingStagePeer(dataclasses.replace(config, host="0.0.0.0", announce_host="127.0.0.3"), 2, 4, peers, "s1"),
    ]
    try:
        yield config, bootstrap, stages
    finally:
        for stage in stages:
            stage.stop()
        bootstrap.shutdown()


def test_stages_announce_the_chosen_addresses_and_the_trainer_reaches_them(swarm) -> None:
    config, bootstrap, (first, second) = swarm
    assert bootstrap.addresses[0].startswith("/ip4/127.0.0.2/tcp/")
    assert first.address.startswith("127.0.0.2:") and second.address.startswith("127.0.0.3:")
    assert first.info()["dht_addresses"][0].startswith("/ip4/127.0.0.2/tcp/")
    assert second.info()["dht_addresses"][0].startswith("/ip4/127.0.0.3/tcp/")
    announced = {p.peer_id: p.address for p in bootstrap.peers(config.dht_key)}
    assert announced == {"s0": first.address, "s1": second.address}
    trainer = Trainer(dataclasses.replace(config, host="127.0.0.4"), 0, bootstrap.addresses)
    try:
        progress = trainer.run(max_samples=2 * config.micro_batch)
    finally:
        trainer.close()
    assert progress["samples"] >= config.micro_batch, progress
    assert first.replica.counters.samples_total > 0 and second.replica.counters.samples_total > 0


def test_a_node_announcing_an_address_it_cannot_reach_warns_at_start(swarm, caplog) -> None:
    config, bootstrap, _ = swarm
    with caplog.at_level(logging.WARNING, logger="swarm.registry.reachability"):
        node = Registry(
            bootstrap.addresses, host="127.0.0.2", announce_host="127.0.0.5", credentials=config.credentials
        )
        node.shutdown()
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "DHT node announces 127.0.0.5:" in warning and "--announce-host" in warning
    assert "which DHT node " in warning  # checked through the bootstrap, not by dialling itself


def test_a_stage_binds_and_announces_the_operators_port(swarm) -> None:
    """`stage_port` (YAML, `swarm train --stage-port`): a fixed port, or the first free one of a range."""
    config, _, (first, _) = swarm
    taken = int(first.address.rsplit(":", 1)[1])
    with socket.socket() as probe:
        probe.bind(("127.0.0.2", 0))
        free = probe.getsockname()[1]
    stage = TrainingStagePeer(dataclasses.replace(config, host="127.0.0.2", stage_port=free), 0, 2, [], "s2")
    try:
        assert stage.address == f"127.0.0.2:{free}"
        socket.create_connection(("127.0.0.2", free), timeout=2).close()
    finally:
        stage.stop()
    spread = dataclasses.replace(config, host="127.0.0.2", stage_port=f"{taken}-{taken + 50}")
    stage = TrainingStagePeer(spread, 0, 2, [], "s3")
    try:
        assert stage.address.startswith("127.0.0.2:") and stage.address != first.address  # the taken one skipped
        assert taken < int(stage.address.rsplit(":", 1)[1]) <= taken + 50
    finally:
        stage.stop()
    with pytest.raises(Exception, match="stage_port"):
        TrainingStagePeer(dataclasses.replace(config, host="127.0.0.2", stage_port=taken), 0, 2, [], "s4")


def test_a_job_on_ray_announces_its_config_address(make_config, local_ray) -> None:
    """The job's bootstrap, its stage actors and its trainer take `host`/`announce_host` from the job config."""
    config = make_config("addresses-job", codec="NONE", micro_batch=4, target_batch=4, steps=1, inflight=1)
    job = TrainingJob(dataclasses.replace(config, host="0.0.0.0", announce_host="127.0.0.3"))
    try:
        job.start()
        progress = job.wait()
        infos = [info for infos in job.stage_infos().values() for info in infos]
    finally:
        job.stop()
    assert job.initial_peers[0].startswith("/ip4/127.0.0.3/tcp/")
    assert [info["address"].split(":")[0] for info in infos] == ["127.0.0.3", "127.0.0.3"]
    assert progress["step"] >= 1, progress
