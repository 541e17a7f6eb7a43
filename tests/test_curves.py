"""Loss-curve pictures: the series read from metrics.jsonl, the PNG, and `pretrain plot`."""
from __future__ import annotations

import json
import struct

import pytest

from png_check import coloured_pixels_per_band, pixels_near
from pretrain.cli import main
from pretrain.training.curves import PANELS, read_curves, read_runs, write_png
from pretrain.errors import PretrainError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write_metrics(run_dir, records, *, tail: str = "") -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(record) for record in records]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n" + tail)


def _train(step, loss, lr, tokens_per_s):
    return {"kind": "train", "step": step, "loss": loss, "lr": lr, "tokens_per_s": tokens_per_s,
            "mfu": 0.1}


RECORDS = [
    {"kind": "run", "world_size": 2, "parameters": 160000},
    _train(1, 6.25, 5e-4, 1000.0),
    _train(2, 6.0, 1e-3, 2000.0),
    {"kind": "eval", "step": 2, "loss": 5.75, "ppl": 314.19},
    _train(3, 5.5, 7.5e-4, 2100.0),
    # the job was requeued and resumed from its step-2 checkpoint: step 3 again, then 4
    {"kind": "run", "world_size": 2, "parameters": 160000},
    _train(3, 5.25, 7.5e-4, 1900.0),
    _train(4, None, 5e-4, 2200.0),  # a non-finite loss is written as null
    {"kind": "eval", "step": 4, "loss": 5.0, "ppl": 148.41},
]


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_the_series_of_a_hand_written_metrics_file(tmp_path):
    _write_metrics(tmp_path / "run-a", RECORDS, tail='{"kind": "train", "step": 5, "lo')
    curves = read_curves(tmp_path / "run-a")
    assert curves.name == "run-a"
    assert curves.train_loss == [(1, 6.25), (2, 6.0), (3, 5.25)]  # the resumed step 3 wins
    assert curves.valid_loss == [(2, 5.75), (4, 5.0)]
    assert curves.lr == [(1, 5e-4), (2, 1e-3), (3, 7.5e-4), (4, 5e-4)]
    assert curves.tokens_per_s == [(1, 1000.0), (2, 2000.0), (3, 1900.0), (4, 2200.0)]
    assert read_curves(tmp_path / "run-a" / "metrics.jsonl") == curves  # the file itself


def test_a_damaged_line_before_the_last_is_an_error(tmp_path):
    run_dir = tmp_path / "damaged"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps(RECORDS[1]) + "\n{oops\n"
                                           + json.dumps(RECORDS[2]) + "\n")
    with pytest.raises(PretrainError, match=r"metrics.jsonl:2 is not a JSON record"):
        read_curves(run_dir)


def test_runs_of_the_same_name_are_named_by_their_paths(tmp_path):
    for parent in ("a", "b"):
        _write_metrics(tmp_path / parent / "run", RECORDS[:3])
    _write_metrics(tmp_path / "other", RECORDS[:2])
    assert [c.name for c in read_runs([tmp_path / "a" / "run", tmp_path / "other"])] == \
        ["run", "other"]
    paths = [str(tmp_path / "a" / "run"), str(tmp_path / "b" / "run")]
    assert [c.name for c in read_runs(paths)] == paths


def test_the_png_is_written_whole_at_its_size(tmp_path):
    _write_metrics(tmp_path / "run-a", RECORDS)
    _write_metrics(tmp_path / "run-b", RECORDS[:4])
    out = tmp_path / "pictures" / "compare.png"
    assert write_png(read_runs([tmp_path / "run-a", tmp_path / "run-b"]), out) == out
    assert _png_size(out) == (1000, 900)
    assert [p.name for p in out.parent.iterdir()] == ["compare.png"]  # no temporary file left
    from matplotlib.image import imread

    assert imread(out).shape == (900, 1000, 4)  # it decodes: RGBA rows x columns
    # each of the three stacked panels draws data, and both runs are drawn in their colours
    assert all(n > 300 for n in coloured_pixels_per_band(out, len(PANELS))), \
        coloured_pixels_per_band(out, len(PANELS))
    assert pixels_near(out, "C0") > 300 and pixels_near(out, "C1") > 300


def test_plot_command_compares_runs(tmp_path, capsys, monkeypatch):
    _write_metrics(tmp_path / "run-a", RECORDS)
    _write_metrics(tmp_path / "run-b", RECORDS[:4])
    out = tmp_path / "both.png"
    main(["plot", str(tmp_path / "run-a"), str(tmp_path / "run-b"), "--output", str(out)])
    assert capsys.readouterr().out == f"[plot] 2 run(s) (run-a, run-b) -> {out}\n"
    assert _png_size(out) == (1000, 900)
    monkeypatch.chdir(tmp_path)
    main(["plot", "run-a"])  # the default output: curves.png in the current directory
    assert capsys.readouterr().out == "[plot] 1 run(s) (run-a) -> curves.png\n"
    assert _png_size(tmp_path / "curves.png") == (1000, 900)


def test_plot_command_exits_2_on_a_run_without_metrics(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write_metrics(tmp_path / "run-a", RECORDS)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        main(["plot", "run-a", "empty"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: 'empty' has no metrics.jsonl") and err.count("\n") == 1
    assert not (tmp_path / "curves.png").exists()  # no picture of the runs that do exist
