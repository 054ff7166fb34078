"""``ttt-zoo list``: the generated table (ttt_zoo/assets/model_stats.json) against the registry, the listing
reading it, and timm's wildcard filters.  Each model's row against a fresh measurement is a column of
tests/test_registry_contract.py."""
import json

import pytest

import ttt_zoo
from ttt_zoo.cli import main
from ttt_zoo.cli import list as list_cmd

REGISTRY = ttt_zoo.list_zoo_models(include_diffusion=True)
TABLE = list_cmd.load_stats_table()


def test_table_covers_the_registry_exactly():
    # regenerate with `python tools/gen_model_stats.py` after adding, removing or changing a model
    assert sorted(TABLE) == sorted(REGISTRY)
    assert json.load(open(list_cmd.STATS_FILE))["img_size"] == list_cmd.DEFAULT_IMG_SIZE


def test_list_reads_the_table_without_building_models(monkeypatch, capsys):
    def refuse(*a, **k):
        raise AssertionError("built a model although the table has it")
    monkeypatch.setattr(list_cmd, "model_stats", refuse)
    assert main(["list"]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    assert [r.split()[0] for r in rows] == REGISTRY
    vit3 = next(r for r in rows if r.split()[0] == "vit3_tiny").split()
    assert float(vit3[1]) == round(TABLE["vit3_tiny"]["params"] / 1e6, 3) and vit3[3] == "3x224x224"


def test_list_measures_other_sizes(capsys):
    assert main(["list", "--filter", "vit3_tiny", "--img-size", "448"]) == 0
    row = next(r for r in capsys.readouterr().out.splitlines() if r.startswith("vit3_tiny "))
    assert row.split()[3] == "3x448x448" and float(row.split()[2]) > 3.9 * TABLE["vit3_tiny"]["gflops"]


@pytest.mark.parametrize("filters,expected", [
    (["vit3*"], [n for n in REGISTRY if n.startswith("vit3")]),     # timm's wildcard: not hvit3_*
    (["*_v[13]"], [n for n in REGISTRY if n.endswith(("_v1", "_v3"))]),
    (["vit3_tiny"], [n for n in REGISTRY if "vit3_tiny" in n]),    # plain text: a substring, as before
    (["dit5*", "t5_tiny"], [n for n in REGISTRY if n.startswith("dit5") or "t5_tiny" in n]),
])
def test_filters_follow_timm(filters, expected):
    assert expected and list_cmd.select_models(REGISTRY, filters) == expected


def test_a_filter_matching_nothing_is_one_clear_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["list", "--filter", "vit4*"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no registered model matches --filter vit4*")


def test_a_closed_pipe_ends_the_listing_quietly(monkeypatch, capsys):
    # `ttt-zoo list | head -3`: the reader goes away; no traceback, no error line, status 0
    class ClosedPipe:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass
    monkeypatch.setattr("sys.stdout", ClosedPipe())
    assert main(["list"]) == 0
    assert capsys.readouterr().err == ""
