"""Run a fine-tuning job on a Ray cluster: `swarm finetune JOB.yaml --ray-address ray://HOST:10001`.

One Ray actor (FinetuneRun) runs job.run_job on the cluster; this process only submits it, polls its progress
reports (a few numbers each, so the Ray Client's slower calls do not matter) and writes the saved adapter's files,
which come back with the result, under the job's output_dir here. The dataset's examples travel with the job (they
are read here: no shared filesystem is assumed); the model's checkpoint must exist at the job's `model` path on
the cluster's machines, where the actor loads the tokenizer and the model's head. The swarm's peers must be
reachable from there.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from swarm.errors import InvalidArgument, SwarmError
from swarm.finetune.config import FinetuneConfig
from swarm.finetune.data import Example
from swarm.security import SwarmCredentials

logger = logging.getLogger(__name__)

REPORT_TIMEOUT_S = 10.0  # one progress poll; a late one is skipped, not fatal


class FinetuneRun:
    """A Ray actor running one job; `report` answers while `run` trains (the actor takes two calls at once)."""

    def __init__(self) -> None:
        self.latest: dict[str, Any] | None = None

    def run(
        self, config: FinetuneConfig, examples: Sequence[Example], credentials: SwarmCredentials
    ) -> tuple[dict[str, Any], dict[str, bytes]]:
        """Train, save the adapter in a temporary directory, and return the summary and the adapter's files."""
        from swarm.finetune.job import run_job

        check_model_here(config.model)
        with tempfile.TemporaryDirectory(prefix="swarm-finetune-") as out:
            here = dataclasses.replace(config, output_dir=Path(out))
            summary = run_job(here, examples, credentials, on_step=self._record)
            files = {str(p.relative_to(out)): p.read_bytes() for p in sorted(Path(out).rglob("*")) if p.is_file()}
        return summary, files

    def report(self) -> dict[str, Any] | None:
        """The latest progress_report(), or None before the first step."""
        return self.latest

    def _record(self, report: dict[str, Any]) -> None:
        self.latest = report


def check_model_here(model: Path) -> None:
    """Raise InvalidArgument when the checkpoint directory is not on this (cluster) machine."""
    if not (Path(model) / "config.json").is_file():
        raise InvalidArgument(
            "model",
            f"{model} is not a checkpoint directory on the Ray cluster (node {socket.gethostname()}): with "
            "--ray-address the job's `model` path must exist on the cluster's machines (only the dataset travels "
            "with the job)",
        )


def run_on_ray(
    config: FinetuneConfig,
    examples: Sequence[Example],
    credentials: SwarmCredentials,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    period_s: float = 1.0,
) -> dict[str, Any]:
    """Run the job in a FinetuneRun actor on the connected Ray cluster; `on_progress` receives its reports. Writes
    the adapter under `config.output_dir` here and returns the summary (its output_dir names the local one)."""
    import ray

    # num_cpus=0, as the trainers of `swarm train`: the client's share of the compute (embeddings, head, loss) is
    # small, and a cluster whose CPUs its peers hold must not leave the job pending with no word.
    actor = ray.remote(FinetuneRun).options(num_cpus=0, max_concurrency=2).remote()
    try:
        done = actor.run.remote(config, list(examples), credentials)
        finished = False
        while not finished:
            finished = bool(ray.wait([done], timeout=period_s)[0])
            _poll(actor, on_progress)
        summary, files = _result(done)
    finally:
        ray.kill(actor, no_restart=True)
    write_files(Path(config.output_dir), files)
    return {**summary, "output_dir": str(config.output_dir), "ran_on": "ray"}


def write_files(directory: Path, files: dict[str, bytes]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def _poll(actor: Any, on_progress: Callable[[dict[str, Any]], None] | None) -> None:
    import ray

    if on_progress is None:
        return
    try:
        report = ray.get(actor.report.remote(), timeout=REPORT_TIMEOUT_S)
    except Exception as error:  # busy or gone: the result says which, the next poll may answer
        logger.debug("progress not available: %s", error)
        return
    if report is not None:
        on_progress(report)


def _result(done: Any) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The actor's result; a SwarmError it raised (a bad model path, an unreachable swarm) is raised as itself."""
    import ray

    try:
        return ray.get(done)
    except ray.exceptions.RayTaskError as error:
        cause = getattr(error, "cause", None)
        if isinstance(cause, SwarmError):
            raise cause from None
        raise
