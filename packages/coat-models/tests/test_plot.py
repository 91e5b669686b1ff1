"""coat-train's loss plot: matplotlib draws it when installed (coat-models[plot]); without it
a run says in one line how to get it and still writes its metrics and summaries."""

import json
import sys

import pytest
from coat_models.train import cli, outdir
from coat_models.train.report import PlotUnavailable, loss_figure, loss_plot_png

RUNS = {
    "bf16": {"train": ([1, 2, 3, 4], [5.8, 5.1, 4.6, 4.2]), "val": ([2, 4], [5.0, 4.3])},
    "coat": {"train": ([1, 2, 3, 4], [5.8, 5.2, 4.7, 4.3]), "val": ([], [])},
}


def test_figure_has_each_run_s_curves_in_its_colour():
    pytest.importorskip("matplotlib")
    from matplotlib import colors

    (ax,) = loss_figure(RUNS).axes
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines) == ["bf16 train", "bf16 val", "coat train"]  # no empty val line
    for label, (name, kind) in {
        "bf16 train": ("bf16", "train"),
        "bf16 val": ("bf16", "val"),
        "coat train": ("coat", "train"),
    }.items():
        x, y = lines[label].get_data()
        assert [[*map(float, x)], [*map(float, y)]] == [list(v) for v in RUNS[name][kind]]
    same = colors.same_color
    assert same(lines["bf16 train"].get_color(), lines["bf16 val"].get_color())
    assert not same(lines["bf16 train"].get_color(), lines["coat train"].get_color())
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(lines)
    assert ax.get_xlabel() == "optimizer step" and ax.get_ylabel() == "loss (nats)"


def test_png_bytes():
    pytest.importorskip("matplotlib")
    png = loss_plot_png(RUNS)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    # IHDR: width and height, big-endian, right after the signature and chunk header
    assert int.from_bytes(png[16:20], "big") == 900 and int.from_bytes(png[20:24], "big") == 560


@pytest.fixture
def no_matplotlib(monkeypatch):
    """Imports of matplotlib fail, as where it is not installed (None in sys.modules makes
    ``import`` raise ImportError)."""
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)


def test_without_matplotlib_the_error_says_how_to_install(no_matplotlib):
    with pytest.raises(PlotUnavailable, match=r"pip install 'coat-models\[plot\]'"):
        loss_figure(RUNS)


def test_run_without_matplotlib_writes_metrics_and_says_how_to_get_the_png(
    tmp_path, capsys, no_matplotlib
):
    (tmp_path / "loss.png").write_bytes(b"an earlier run's picture")
    (tmp_path / outdir.LOCK_FILE).write_text("4242\n")  # an earlier run's --out (else refused)
    argv = "--preset tiny --steps 2 --eval-every 2 --batch-size 2 --seq-len 32 --eval-batches 1"
    code = cli.main([*argv.split(), "--corpus-mib", "1", "--no-progress", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    hint = [line for line in out.splitlines() if line.startswith("loss curves")]
    assert hint == [
        "loss curves: not drawn, matplotlib is not installed: pip install "
        "'coat-models[plot]' (matplotlib) to get loss.png"
    ]
    assert not (tmp_path / "loss.png").exists()  # the stale picture is gone
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["plot"] is None and summary["runs"][0]["steps"] == 2
    records = (tmp_path / "bf16" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["type"] for r in records] == ["train", "train", "eval"]
