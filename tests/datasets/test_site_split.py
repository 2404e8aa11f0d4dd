"""``medseg data split-sites`` on the real Task04_Hippocampus: unequal sites, the uint8-stored cases
at one site, labelled held-out cases per site that training never sees; read back by medseg's own
dataset loader."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import pytest

from medseg.cli.main import main
from medseg.datasets.decathlon import load_dataset
from medseg.errors import ConfigError

HIPPO = Path(__file__).resolve().parents[3] / "shared" / "data" / "Task04_Hippocampus"
needs_hippo = pytest.mark.skipif(not (HIPPO / "dataset.json").is_file(), reason=f"no real data at {HIPPO}")


@needs_hippo
def test_hippocampus_splits_into_unlike_sites_with_their_own_held_out_cases(tmp_path: Path, capsys) -> None:
    out = tmp_path / "sites"
    argv = ["data", "split-sites", "--data", str(HIPPO), "--out", str(out), "--sites", "a=90,b=60,c=50"]
    assert main([*argv, "--test", "10", "--stored-as", "uint8=c", "--seed", "3"]) in (0, None)
    assert "c: {dir: " in capsys.readouterr().out
    seen: list[str] = []
    for site, n in (("a", 90), ("b", 60), ("c", 50)):
        train, held = load_dataset(out / site), load_dataset(out / f"{site}-test")
        assert (len(train.training), len(held.training)) == (n - 10, 10)
        assert train.labels == held.labels == {0: "background", 1: "Anterior", 2: "Posterior"}
        names = [Path(c["image"]).name for c in train.training + held.training]
        seen += names
        dtypes = {str(nib.load(c["image"]).get_data_dtype()) for c in train.training + held.training}
        assert dtypes == ({"uint8", "float32"} if site == "c" else {"float32"}), (site, dtypes)
        for c in train.training + held.training:
            assert Path(c["label"]).name == Path(c["image"]).name and Path(c["image"]).is_file()
    assert len(seen) == len(set(seen)) == 200  # every case once
    uint8 = [n for n in seen if str(nib.load(HIPPO / "imagesTr" / n).get_data_dtype()) == "uint8"]
    assert len(uint8) == 43
    split = json.loads((out / "split.json").read_text())
    again = tmp_path / "again"
    assert main(
        [
            *argv[:-4],
            "--out",
            str(again),
            "--sites",
            "a=90,b=60,c=50",
            "--stored-as",
            "uint8=c",
            "--seed",
            "3",
        ]
    ) in (0, None)
    assert json.loads((again / "split.json").read_text())["sites"] == split["sites"]  # same seed, same split


@needs_hippo
def test_impossible_splits_say_why(tmp_path: Path) -> None:
    from medseg.datasets.site_split import parse_counts, split_sites

    with pytest.raises(ConfigError, match="asks for 260 cases"):
        split_sites(HIPPO, tmp_path, parse_counts("a=200,b=60"), 5)
    with pytest.raises(ConfigError, match="43 images are stored as uint8, more than site b's 20"):
        split_sites(HIPPO, tmp_path, parse_counts("a=100,b=20"), 5, ("uint8", "b"))
    with pytest.raises(ConfigError, match="SITE=CASES"):
        parse_counts("a=90,a=3")
