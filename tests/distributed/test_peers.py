"""The peers of gssp between sites (bsp-hier, fedavg, diloco): config rules, the outer optimizer, the
round checks, and a 3-rank job against independent single-process references."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from medseg.config import config_from_dict
from medseg.distributed.comm.checks import UpdateRefused
from medseg.distributed.sync.outer import OuterNesterov
from medseg.distributed.sync.rounds import check_counts, site_lists
from medseg.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _dist(**dist: object) -> dict:
    return {"dist": dist, "train": {"epochs": 4}}


@pytest.mark.parametrize(
    ("dist", "words"),
    [
        ({"sync": "diloco", "compression": "fp16"}, "float32"),
        ({"sync": "fedavg", "compression": "fixed"}, "float32"),
        ({"sync": "bsp-hier", "compression": "fixed"}, "float32"),
        ({"sync": "bsp-hier", "local_norm": True}, "bsp-hier averages every gradient"),
        ({"sync": "diloco", "groups": [[0], [1]]}, "one group per site"),
        ({"sync": "fedavg", "local_epochs": 3}, "multiple"),
        ({"sync": "fedavg", "local_epochs": 2, "local_steps": 5}, "not both"),
        ({"sync": "diloco", "outer_momentum": 1.0}, "outer_momentum"),
        ({"sync": "diloco", "inner_steps": 0}, "inner_steps"),
    ],
)
def test_nonsense_peer_configs_are_refused(dist: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        config_from_dict(_dist(**dist))


def test_peer_configs_load_with_the_papers_defaults() -> None:
    d = config_from_dict(_dist(sync="diloco")).dist
    assert (d.inner_steps, d.outer_lr, d.outer_momentum) == (500, 0.7, 0.9)
    assert config_from_dict(_dist(sync="fedavg", local_epochs=2)).dist.local_epochs == 2
    assert config_from_dict(_dist(sync="bsp-hier")).dist.sync == "bsp-hier"


def test_outer_nesterov_is_torch_sgd_with_nesterov() -> None:
    """The outer rule, written out, against torch.optim.SGD(nesterov=True) fed Δ as the gradient."""
    g = torch.Generator().manual_seed(3)
    theta = torch.randn(50, generator=g)
    ref = torch.nn.Parameter(theta.clone())
    sgd = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    outer = OuterNesterov(0.7, 0.9)
    for _ in range(5):
        delta = torch.randn(50, generator=g)
        theta = outer.step(theta, delta)
        ref.grad = delta.clone()
        sgd.step()
    assert torch.allclose(theta, ref.detach(), atol=1e-6), (theta - ref).abs().max()


def test_round_counts_are_checked() -> None:
    sources = ["rank 0 (site a)", "rank 2 (site b)"]
    check_counts([[40, 5], [60, 5]], sources, own=0, same_steps=True)
    with pytest.raises(UpdateRefused, match="site b") as inflated:
        check_counts([[40, 5], [40_000, 5]], sources, own=0, same_steps=False)
    assert inflated.value.rank == 2
    with pytest.raises(UpdateRefused, match="steps"):
        check_counts([[40, 5], [60, 6]], sources, own=0, same_steps=True)
    check_counts([[40, 5], [60, 6]], sources, own=0, same_steps=False)  # epoch rounds may differ
    with pytest.raises(UpdateRefused, match="0 samples"):
        check_counts([[40, 5], [0, 5]], sources, own=0, same_steps=False)


def test_site_lists_orders_sites_by_their_lowest_rank() -> None:
    assert site_lists(["b", "a", "b", "c"]) == [[0, 2], [1], [3]]


@pytest.mark.skipif(not (BIN / "horovodrun").exists(), reason="Horovod is built by `make setup`")
def test_peers_equal_their_single_process_references() -> None:
    """3 ranks in 2 sites (2 + 1, unequal samples per step): bsp-hier = plain Horovod, diloco and fedavg
    = their one-process replays in plain torch, all within 1e-5; tampered parts refused everywhere."""
    pytest.importorskip("horovod.torch")
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", MEDSEG_JOB_SECRET=secrets.token_hex(32))
    cmd = [str(BIN / "horovodrun"), "-np", "3", "-H", "localhost:3", "--gloo", sys.executable]
    script = str(ROOT / "tests" / "distributed" / "mp" / "peers_replay.py")
    proc = subprocess.run([*cmd, script], capture_output=True, text=True, timeout=400, env=env, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "FAIL " not in out, out[-5000:]
    assert out.count("PASS ") == 11, out[-5000:]
