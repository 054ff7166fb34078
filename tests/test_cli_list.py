"""``ttt-zoo list [PATTERN ...]`` against timm's own answers over the registry: wildcards (timm.list_models),
several patterns, ``--exclude`` (exclude_filters), ``--pretrained`` and the pretrained column (the pretrained
cfgs with a hub id, url or file), and one line with the closest names when nothing matches."""
import fnmatch

import pytest
import timm
from timm.models import get_arch_pretrained_cfgs

from ttt_zoo.cli import main
from ttt_zoo.registry import list_zoo_models

REGISTRY = list_zoo_models(include_diffusion=True)


def listed(capsys, *argv):
    assert main(["list", *argv]) == 0
    rows = [r.split() for r in capsys.readouterr().out.splitlines()[1:]]
    return {r[0]: r[-1] for r in rows}  # model -> its pretrained column


def in_zoo(names):
    return sorted(n for n in names if n in REGISTRY)


def released(name):
    """Tags of ``name``'s pretrained cfgs that point at weights (timm's rule: a hub id, a url or a file)."""
    return [key.partition(".")[2] for key, cfg in get_arch_pretrained_cfgs(name).items()
            if cfg.hf_hub_id or cfg.url or cfg.file]


@pytest.mark.parametrize("patterns", [["vit3*"], ["*_v[13]"], ["dit5*", "hvit3_?????"], ["vit3*", "*tiny*"]])
def test_patterns_match_as_timm_list_models(capsys, patterns):
    expected = in_zoo(timm.list_models(patterns))
    assert expected and sorted(listed(capsys, *patterns)) == expected
    assert sorted(listed(capsys, "--filter", *patterns)) == expected  # the older spelling, the same


def test_exclude_follows_timm_exclude_filters(capsys):
    expected = in_zoo(timm.list_models("vit3*", exclude_filters=["*_v1", "*_v6"]))
    assert expected and sorted(listed(capsys, "vit3*", "--exclude", "*_v1", "*_v6")) == expected
    assert all(not n.endswith(("_v1", "_v6")) for n in expected)


def test_pretrained_lists_the_models_with_released_weights(capsys):
    with_weights = [n for n in REGISTRY if released(n)]
    assert 0 < len(with_weights) < len(REGISTRY)  # both kinds exist: the filter is seen to work
    assert sorted(listed(capsys, "--pretrained")) == sorted(with_weights)
    assert sorted(listed(capsys, "--pretrained", "dit*")) == sorted(n for n in with_weights if n.startswith("dit"))


def test_the_pretrained_column(capsys):
    rows = listed(capsys)
    assert sorted(rows) == sorted(REGISTRY)
    for name, column in rows.items():
        assert column == (",".join(sorted(released(name))) or "-"), name


@pytest.mark.parametrize("argv,asked,closest", [
    (["vit4*"], "'vit4*'", "vit3_"),
    (["vit3_tinny"], "'vit3_tinny'", "vit3_tiny"),
    (["--pretrained", "vit3_tiny_v*"], "'vit3_tiny_v*' with released weights (--pretrained)", "vit3_tiny"),
])
def test_nothing_matches_one_line_with_the_closest_names(capsys, argv, asked, closest):
    with pytest.raises(SystemExit) as e:
        main(["list", *argv])
    assert e.value.code == 2  # a user error, as every other: the pattern (a typo, most often) is what is wrong
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    line = err.strip()
    assert line.startswith(f"error: no registered model matches {asked}; closest: ")
    names = line.split("closest: ")[1].split(", ")
    assert 1 <= len(names) <= 3 and all(n in REGISTRY for n in names) and names[0].startswith(closest)
    if "--pretrained" in argv:
        assert all(released(n) for n in names)


def test_nothing_close_says_how_to_list_all(capsys):
    with pytest.raises(SystemExit):
        main(["list", "zzzz"])
    err = capsys.readouterr().err.strip()
    assert err == ("error: no registered model matches 'zzzz'; use shell wildcards as timm does (e.g. 'vit3*'), "
                   "or run `ttt-zoo list` for all")


def test_plain_text_still_matches_a_substring(capsys):
    assert sorted(listed(capsys, "tiny_v3")) == sorted(n for n in REGISTRY if fnmatch.fnmatchcase(n, "*tiny_v3*"))
