"""scripts/tile_clocks.py, the summary of a MEGAMOE_TILE_CLOCKS build's per-tile clock records (on made-up
records, so that no GPU is needed)."""

import importlib.util
import io
import pathlib
from contextlib import redirect_stdout

REPO = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("tile_clocks", REPO / "scripts" / "tile_clocks.py")
tile_clocks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tile_clocks)


def record(n=2048, k=768, cwg=0, tiles=10, stages=120, top=100, wait=200, loop=30000, epi=9700):
    total = top + wait + loop + epi
    return (f"TILECLK form=0 act=0 BN=256 cl=1 tma=0 gA=0 N={n} K={k} cta=0 cwg={cwg} tiles={tiles} "
            f"kstages={stages} top={top} wait={wait} loop={loop} epi={epi} total={total}\n")


def test_records_of_one_configuration_are_summed_per_tile():
    lines = ["bench_layer: H=2048 ...\n", record(cwg=0), record(cwg=1, loop=32000, epi=7700), "other output\n",
             record(k=1536, tiles=5, stages=120, loop=60000, epi=4700)]
    rows = tile_clocks.summary(tile_clocks.parse(lines))
    assert [r[0][-1] for r in rows] == ["768", "1536"]  # grouped by problem, K apart, in numeric order
    key, n, per_tile, per_stage, share = rows[0]
    assert n == 2
    assert per_tile == {"top": 10.0, "wait": 20.0, "loop": 3100.0, "epi": 870.0}
    assert per_stage == 62000 / 240
    assert abs(share["epi"] - 17400 / 80000) < 1e-12


def test_no_records_is_said_and_fails():
    path = REPO / "python" / "tests" / "test_tile_clocks.py"  # any file without records
    out = io.StringIO()
    with redirect_stdout(out):
        assert tile_clocks.main([str(path)]) == 1
    assert "no TILECLK records" in out.getvalue()


def test_dropped_records_are_reported(tmp_path):
    f = tmp_path / "bench.txt"
    f.write_text(record() + "TILECLK dropped=7\n")
    out = io.StringIO()
    with redirect_stdout(out):
        assert tile_clocks.main([str(f)]) == 0
    text = out.getvalue()
    assert "TILECLK dropped=7" in text and "256" in text
