"""``ttt-zoo list``: the generated table (ttt_zoo/assets/model_stats.json) against the registry, the listing
reading it, and timm's wildcard filters; the papers' counts beside ours in docs/models.md (ttt_zoo/assets/
paper_stats.json), within tolerance where a paper counts the same thing.  Each model's row against a fresh
measurement is a column of tests/test_registry_contract.py."""
import importlib.util
import json
import os

import pytest

import ttt_zoo
from ttt_zoo.cli import main
from ttt_zoo.cli import list as list_cmd
from ttt_zoo.hub.cards import load_paper_stats, paper_counts

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


# ----- the papers' counts beside ours (docs/models.md, ttt_zoo/assets/paper_stats.json) -----

def _generator():
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "gen_model_stats.py")
    spec = importlib.util.spec_from_file_location("gen_model_stats", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GEN = _generator()
PAPER = load_paper_stats()
PAPER_ROWS = sorted(PAPER["models"])


def test_docs_show_the_generated_comparison():
    # regenerate with `python tools/gen_model_stats.py --docs` after changing paper_stats.json or the table
    text = open(GEN.DOCS_FILE).read()
    assert text.count(GEN.BEGIN) == 1 and text.count(GEN.END) == 1
    assert GEN.render_docs_section(TABLE) in text


def test_every_family_has_a_table_and_a_note():
    assert sorted(PAPER["families"]) == sorted(ttt_zoo.list_zoo_families(include_diffusion=True))
    section = GEN.render_docs_section(TABLE)
    for family, info in PAPER["families"].items():
        assert f"### `{family}`" in section and GEN.family_note(info) in section
    assert set(PAPER_ROWS) <= set(REGISTRY)
    assert all(source in PAPER["sources"] for _, _, source in PAPER["models"].values())


@pytest.mark.parametrize("measured,printed,ok", [
    (1.22, "1.2", True), (1.26, "1.2", True), (1.29, "1.2", False),    # 1.2 +- (3 % + 0.05)
    (23.33, "23.35", True), (22.6, "23.35", False), (6.15, "6", True), (6.7, "6", False)])
def test_tolerance_counts_the_papers_rounding(measured, printed, ok):
    assert GEN.within_paper(measured, printed) is ok


@pytest.mark.parametrize("name", PAPER_ROWS)
def test_ours_against_the_paper(name):
    row, paper = TABLE[name], paper_counts(name)
    info = PAPER["families"][GEN.family_of(name, PAPER["families"])]
    assert GEN.within_paper(row["params"] / 1e6, paper["params"]), "parameters: every paper counts the same"
    if "off_percent" not in info:  # the paper counts the same thing
        assert GEN.within_paper(row["gflops"], paper["gflops"])
        return
    low, high = info["off_percent"]  # the stated difference, as the note says
    assert low <= round(100 * (row["gflops"] / float(paper["gflops"]) - 1)) <= high
    if "count_as_paper" in info:  # counted the paper's way, within tolerance
        assert GEN.within_paper(row["gflops_as_paper"], paper["gflops"])


def test_counted_as_paper_is_measured_not_stored():
    # one fresh measurement of a stored 'counted as the paper' number (Vision-TTT, projections per direction)
    kwargs = PAPER["families"]["visionttt"]["count_as_paper"]
    fresh = GEN.gflops_counted_as_paper("visionttt_tiny", kwargs, list_cmd.DEFAULT_IMG_SIZE)
    assert fresh == pytest.approx(TABLE["visionttt_tiny"]["gflops_as_paper"], rel=1e-9)
    assert fresh > 1.15 * TABLE["visionttt_tiny"]["gflops"]


def test_cards_take_the_paper_counts_from_the_one_table():
    from ttt_zoo.hub.cards import PAPER_RESULTS
    for name in ("vit3_tiny", "hvit3_base", "dit3_b_8"):
        counts = paper_counts(name + ".in1k")
        assert PAPER_RESULTS[name]["params"] == counts["params"] + "M"
        assert PAPER_RESULTS[name]["flops"] == counts["gflops"] + "G"
    assert paper_counts("dit5_xl_2") is None and paper_counts("vit3_tiny_v1") is None
