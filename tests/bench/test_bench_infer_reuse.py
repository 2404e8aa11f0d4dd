"""``medseg bench infer --reuse-log``: runs an interrupted invocation printed are taken, not run again."""

from __future__ import annotations

from pathlib import Path

import pytest

from medseg.bench import infer as bench_infer
from medseg.cli.main import main

SHAPE = (40, 36, 16)


def test_interrupted_run_is_resumed_from_its_log(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "bench"
    real = bench_infer._run_child
    calls: list[str] = []

    def interrupted(bundle, shape, variant, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if variant == "new-stream":
            raise KeyboardInterrupt  # the first invocation stops after old and new
        calls.append(variant)
        return real(bundle, shape, variant, *args, **kwargs)

    monkeypatch.setattr(bench_infer, "_run_child", interrupted)
    with pytest.raises(KeyboardInterrupt):
        bench_infer.bench_infer(
            work, quick=True, rounds=1, sizes=[SHAPE], classes=(3,), variants=("old", "new", "new-stream")
        )
    log = capsys.readouterr().out
    assert calls == ["old", "new"]
    reuse = bench_infer.runs_from_log(log)
    assert set(reuse) == {(SHAPE, 3, "old"), (SHAPE, 3, "new")}
    assert (work / "labels-40x36x16-3-old.npy").exists()  # left by the interruption

    calls.clear()

    def counted(bundle, shape, variant, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append(variant)
        return real(bundle, shape, variant, *args, **kwargs)

    monkeypatch.setattr(bench_infer, "_run_child", counted)
    result = bench_infer.bench_infer(
        work,
        quick=True,
        rounds=1,
        sizes=[SHAPE],
        classes=(3,),
        variants=("old", "new", "new-stream"),
        reuse=reuse,
    )
    assert calls == ["new-stream"]  # old and new were taken from the log
    case = result["cases"][0]
    assert case["variants"]["old"]["runs"][0]["reused"] is True
    assert result["reused"] == ["40x36x16 x 3 old round 1", "40x36x16 x 3 new round 1"]
    # the labels the interrupted run left were compared like fresh ones
    assert case["variants"]["new"]["vs_old"]["differing_voxels"] == 0
    assert case["variants"]["new-stream"]["vs_old"]["differing_voxels"] == 0
    assert "Taken from an interrupted earlier invocation" in bench_infer.run_note(result)


def test_reused_run_without_its_labels_is_run_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A logged first-round run whose label map is gone cannot be compared: it is run again."""
    line = '   40x36x16   3 new       {"seconds": 9.0, "peak_bytes": 1, "predicted_peak_bytes": 1}'
    reuse = bench_infer.runs_from_log(line + "\nnoise line\n")
    assert reuse == {(SHAPE, 3, "new"): [{"seconds": 9.0, "peak_bytes": 1, "predicted_peak_bytes": 1}]}
    calls: list[str] = []
    monkeypatch.setattr(
        bench_infer,
        "_run_child",
        lambda b, s, v, *a, **k: calls.append(v) or {"error": "not run in this test"},
    )
    bench_infer.bench_infer(
        tmp_path, quick=True, rounds=1, sizes=[SHAPE], classes=(3,), variants=("new",), reuse=reuse
    )
    assert calls == ["new"]


def test_reuse_log_bad_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    json_out = tmp_path / "r.json"
    code = main(["bench", "infer", "--json", str(json_out), "--reuse-log", str(tmp_path / "missing.log")])
    assert code == 2 and "no such file" in capsys.readouterr().err
    empty = tmp_path / "empty.log"
    empty.write_text("nothing finished\n")
    code = main(["bench", "infer", "--json", str(json_out), "--reuse-log", str(empty)])
    assert code == 2 and "holds no finished runs" in capsys.readouterr().err
    code = main(["bench", "infer", "--json", str(json_out), "--sizes", "512x512"])
    assert code == 2 and "IxJxK" in capsys.readouterr().err
