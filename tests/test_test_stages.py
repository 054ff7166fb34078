"""tools/test_stages.py, the runner behind `make test`: counts, skip reasons, the missing-dependency rule, summary."""
import importlib.util
import os

_spec = importlib.util.spec_from_file_location(
    "test_stages", os.path.join(os.path.dirname(__file__), "..", "tools", "test_stages.py"))
TS = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(TS)

REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="6">
<testcase classname="tests.test_a" name="test_ok" time="1.5"/>
<testcase classname="tests.test_a" name="test_slow[x]" time="12.25"/>
<testcase classname="tests.test_b" name="test_bad" time="0.5"><failure message="assert 1 == 2">trace</failure></testcase>
<testcase classname="tests.test_b" name="test_gpu" time="0.0"><skipped message="needs CUDA"/></testcase>
<testcase classname="tests.test_b" name="test_gpu2" time="0.0"><skipped message="needs CUDA"/></testcase>
<testcase classname="tests.test_c" name="test_fx" time="0.0"><skipped message="could not import 'onnx': No module named 'onnx'"/></testcase>
</testsuite></testsuites>
"""


def test_report_counts_skips_and_missing_dependencies(tmp_path):
    path = tmp_path / "r.xml"
    path.write_text(REPORT)
    res = TS.Result("main")
    TS._parse(str(path), res, str(tmp_path))
    assert (res.passed, res.failed, res.errors, res.skipped) == (2, 1, 0, 3)
    assert res.skips == {"needs CUDA": 2, "could not import 'onnx': No module named 'onnx'": 1}
    # the failure, and the skip for a missing package, which a full run treats as a failure
    assert len(res.failures) == 2
    assert res.failures[0].startswith("tests/test_b.py::test_bad: assert 1 == 2")
    assert "missing dependency" in res.failures[1] and "onnx" in res.failures[1]
    res.wall = 90.0
    text = TS.summary([res], 90.0)
    assert "| main     |    1.5 m |      2 |      1 |      0 |       3 | FAILED |" in text
    assert "  main: 2 x needs CUDA" in text
    slow = text.split("10 slowest tests:\n")[1].splitlines()
    assert slow[0] == "      12.2 s  [main] tests/test_a.py::test_slow[x]" and slow[1].endswith("test_ok")
    assert "      13.8 s  [main] tests/test_a.py" in text  # per file: 1.5 + 12.25


def test_unknown_stage_is_one_error_line(capsys):
    assert TS.main(["--stages", "main,nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: unknown stage(s) ['nope']; choose from main,kernels,compile,mm,timm"]
