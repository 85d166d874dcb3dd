"""Where a rank of flexcomm-train computes: one GPU per rank of a machine, gloo when ranks share a GPU."""

import pytest
import torch

from flexcomm.launch import MACHINE_RANK_ENV, MACHINE_RANKS_ENV
from flexcomm.train.devices import choose_device


def test_cpu_when_asked_or_without_gpus() -> None:
    assert choose_device("cpu", {"LOCAL_RANK": "1"}, gpus=8) == (torch.device("cpu"), "gloo")
    assert choose_device("auto", {"LOCAL_RANK": "1"}, gpus=0) == (torch.device("cpu"), "gloo")


def test_torchrun_ranks_take_their_local_gpu_over_nccl() -> None:
    for local in range(4):
        env = {"LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": "4"}
        assert choose_device("auto", env, gpus=4) == (torch.device("cuda", local), "nccl")


def test_emulated_hosts_on_one_machine_spread_over_its_gpus() -> None:
    # Every emulated host has LOCAL_RANK 0; without the machine rank all would share GPU 0.
    devices = [choose_device("cuda", {"LOCAL_RANK": "0", MACHINE_RANK_ENV: str(r), MACHINE_RANKS_ENV: "4"}, gpus=4)
               for r in range(4)]
    assert devices == [(torch.device("cuda", r), "nccl") for r in range(4)]


def test_ranks_outnumbering_gpus_share_them_over_gloo() -> None:
    # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"); gloo takes CUDA tensors.
    devices = [choose_device("cuda", {MACHINE_RANK_ENV: str(r), MACHINE_RANKS_ENV: "2"}, gpus=1) for r in range(2)]
    assert devices == [(torch.device("cuda", 0), "gloo")] * 2


def test_bad_device_requests_are_refused() -> None:
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda, got 'tpu'"):
        choose_device("tpu", {}, gpus=1)
    with pytest.raises(ValueError, match="--device cuda, but torch sees no CUDA device"):
        choose_device("cuda", {}, gpus=0)
