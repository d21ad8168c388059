"""Data parallel's configuration: `--data-parallel-size` / `-dp` and its bad values, each core's
KV-event sockets (vLLM's offsets: a tcp port + the rank, `_dp<rank>` after any other endpoint) and
the clash of a core's socket with another's replay socket, and each core's device: a GPU of its
own (never a silent fall back to the CPU when there are too few) or its own slice of the CPUs,
applied in a fresh process as the engine process applies it."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path
from typing import Any

import pytest

from api.cli import build_parser, main, server_config
from engine.cache_events.config import KVEventsConfig
from engine.client import core_client
from engine.client.core_client import CoreDevice
from engine.config import EngineConfig
from engine.errors import ConfigError

EVENTS = dict(enable_kv_cache_events=True, publisher="zmq")


def test_the_flag_and_its_short_form_map_onto_the_config() -> None:
    for argv in (["--data-parallel-size", "3"], ["-dp", "3"]):
        assert server_config(build_parser().parse_args(["serve", *argv])).engine.data_parallel_size == 3


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["-dp", "0"], "--data-parallel-size: must be positive"),
        (["-dp", "2", "--in-process-engine"], "drop --in-process-engine"),
        (
            [
                "-dp",
                "2",
                "--kv-events-config",
                '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}',
            ],
            "tcp://*:5558",
        ),
    ],
)
def test_bad_values_exit_2_saying_why(argv: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", *argv]) == 2
    assert words in capsys.readouterr().err


def test_each_core_publishes_on_its_own_sockets() -> None:
    config = EngineConfig(
        data_parallel_size=3,
        kv_events_config=KVEventsConfig(**EVENTS, endpoint="tcp://*:5557", replay_endpoint="tcp://*:5600"),
    )
    ranks = [config.for_rank(rank) for rank in range(3)]
    assert [c.data_parallel_rank for c in ranks] == [0, 1, 2]
    assert [c.kv_events_config.endpoint for c in ranks] == ["tcp://*:5557", "tcp://*:5558", "tcp://*:5559"]
    assert [c.kv_events_config.replay_endpoint for c in ranks] == ["tcp://*:5600", "tcp://*:5601", "tcp://*:5602"]
    ipc = KVEventsConfig(**EVENTS, endpoint="ipc:///tmp/kv.sock").for_rank(2)
    assert ipc.endpoint == "ipc:///tmp/kv.sock_dp2" and ipc.replay_endpoint is None
    with pytest.raises(ConfigError, match="no port"):
        KVEventsConfig(**EVENTS, endpoint="tcp://host").for_rank(1)


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """Four usable CPUs (4..7) and `gpus` NVIDIA GPUs as the driver lists them."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5, 6, 7})
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    listing = tmp_path / "gpus"
    monkeypatch.setattr(core_client, "NVIDIA_GPUS", str(listing))

    def with_gpus(n: int) -> None:
        for i in range(n):
            (listing / f"0000:0{i}:00.0").mkdir(parents=True)

    return with_gpus


def test_on_cpus_each_core_gets_its_own_slice(machine: Any) -> None:
    devices = [CoreDevice.for_rank(EngineConfig(data_parallel_size=2), rank) for rank in range(2)]
    assert devices == [CoreDevice(0, None, (4, 5), 2), CoreDevice(1, None, (6, 7), 2)]
    assert devices[1].describe() == "CPUs 6,7, 2 torch threads"
    crowded = CoreDevice.for_rank(EngineConfig(data_parallel_size=8), 5)  # more cores than CPUs
    assert crowded == CoreDevice(5, None, (), 1) and crowded.describe() == "every CPU, 1 torch thread"


def test_on_gpus_each_core_gets_its_own_and_too_few_is_an_error(machine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    machine(2)
    config = EngineConfig(data_parallel_size=2)
    assert [CoreDevice.for_rank(config, r).gpu for r in range(2)] == ["0", "1"]
    assert CoreDevice.for_rank(config, 1).cpus == ()  # not pinned: the GPU does the work
    assert CoreDevice.for_rank(EngineConfig(data_parallel_size=2, device="cpu"), 1).gpu is None
    with pytest.raises(ConfigError, match=r"--data-parallel-size 3: one GPU per engine core, but 2 are visible"):
        CoreDevice.for_rank(EngineConfig(data_parallel_size=3), 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")  # the operator's choice wins over the driver's list
    assert [CoreDevice.for_rank(config, r).gpu for r in range(2)] == ["3", "5"]


def _applied(device: CoreDevice, out: Any) -> None:
    device.apply()
    import torch

    out.put((os.environ.get("CUDA_VISIBLE_DEVICES"), sorted(os.sched_getaffinity(0)), torch.get_num_threads()))


def test_a_core_process_applies_its_device_before_torch_starts() -> None:
    cpu = min(os.sched_getaffinity(0))
    ctx = multiprocessing.get_context("spawn")
    out = ctx.SimpleQueue()
    child = ctx.Process(target=_applied, args=(CoreDevice(1, "7", (cpu,), 1), out))
    child.start()
    child.join(120)
    assert child.exitcode == 0
    assert out.get() == ("7", [cpu], 1)
