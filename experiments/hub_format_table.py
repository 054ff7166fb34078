"""The Hub format's one owner (issue 36, items 0, 6 and 8): its key table, the grep counts, and every malformed
config.json of tests/test_hub_format.py through the command line (exit status and the one line).

    python experiments/hub_format_table.py [--out experiments/results/hub_format.md]

A tiny vit3_tiny folder is converted, then each case of ``tests/test_hub_format.py`` (CASES, RAW: the same table,
imported) is written into a copy and given to ``ttt-zoo push COPY --dry-run --no-source-check`` in a subprocess;
plus a bit flip in the weights' data section (``push`` and ``predict``) and ``convert --force --out LINK``.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402
import timm  # noqa: E402

from ttt_zoo import hub, hub_format  # noqa: E402
from ttt_zoo.fileio import atomic_write  # noqa: E402
from test_hub_format import CASES, RAW, SMALL, _set  # noqa: E402  (the test's table, not a copy)

KEYS = ("architecture|num_classes|num_features|global_pool|label_names|label_descriptions|model_args|pretrained_cfg|"
        "ttt_zoo|weights_sha256|source_sha256|source_file|hub_id")
GREPS = [
    ("config.json writers (definitions)", "grep -rn 'def write_config' ttt_zoo"),
    ("callers of the writer", "grep -rn 'write_config(' ttt_zoo | grep -v 'def write_config'"),
    ("JSON / file writes in the Hub modules", "grep -rnE 'json\\.dump\\(|atomic_write\\(|open\\([^)]*\"w\"' ttt_zoo/hub "
     "ttt_zoo/hub_format.py ttt_zoo/sd3/hub.py ttt_zoo/cli/convert.py ttt_zoo/cli/push.py"),
    ("config.json readers (definitions)", "grep -rn 'def read_config' ttt_zoo"),
    ("json.load in the Hub modules and their callers", "grep -rn 'json\\.load(' ttt_zoo/hub ttt_zoo/hub_format.py "
     "ttt_zoo/checkpoint.py ttt_zoo/cli/predict.py ttt_zoo/cli/convert.py ttt_zoo/cli/push.py"),
    ("Hub-key literals outside hub_format.py", f"grep -rnE '\"({KEYS})\"' ttt_zoo/hub ttt_zoo/sd3/hub.py "
     "ttt_zoo/cli/convert.py ttt_zoo/cli/push.py ttt_zoo/cli/predict.py | grep -v hub_format.py"),
]


def cli(*args):
    r = subprocess.run([sys.executable, "-m", "ttt_zoo", *args], capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"))
    err = r.stderr.strip().splitlines()
    return r.returncode, (err[0] if err else ""), len(err), "Traceback" in r.stderr


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "experiments", "results", "hub_format.md"))
    args = p.parse_args()
    lines = ["# The Hub format's one owner: `ttt_zoo/hub_format.py`", "",
             "Written by `experiments/hub_format_table.py` (issue 36, items 0, 6, 8).", "", "## The key table", "",
             hub_format.key_table(), "", "## grep counts", ""]
    for title, cmd in GREPS:
        out = subprocess.run(cmd, shell=True, capture_output=True, text=True, cwd=ROOT).stdout.strip()
        n = len(out.splitlines()) if out else 0
        lines += [f"### {title}: {n}", "", "```text", f"$ {cmd}", out, "```", ""]
    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(0)
        src = os.path.join(d, "src.pth")
        torch.save(timm.create_model("vit3_tiny", num_classes=10, **SMALL).state_dict(), src)
        folder = os.path.join(d, "hub")
        hub.convert_checkpoint(src, "vit3_tiny.digits", folder, model_args=SMALL, flops=False)
        rows = []

        def case(name, write):
            copy = os.path.join(d, "case")
            shutil.rmtree(copy, ignore_errors=True)
            shutil.copytree(folder, copy)
            write(copy)
            rc, first, n, tb = cli("push", copy, "--dry-run", "--no-source-check")
            rows.append(f"| {name} | {rc} | {n} | {'yes' if tb else 'no'} | `{first.replace(copy, 'COPY')}` |")

        for name, key, value, _ in CASES:
            def write(copy, key=key, value=value):
                with open(os.path.join(copy, "config.json"), encoding="utf-8") as f:
                    cfg = json.load(f)
                _set(cfg, key, value)
                atomic_write(os.path.join(copy, "config.json"), json.dumps(cfg))
            case(name, write)
        for name, raw, _ in RAW:
            case(name, lambda copy, raw=raw: atomic_write(os.path.join(copy, "config.json"), raw, binary=True))

        def flip(copy):
            w = os.path.join(copy, "model.safetensors")
            data = bytearray(open(w, "rb").read())
            data[-5] ^= 1
            atomic_write(w, bytes(data), binary=True)
        case("a bit flip in model.safetensors' data", flip)
        lines += ["## Every malformed folder through `ttt-zoo push COPY --dry-run --no-source-check`", "",
                  "| case | exit | stderr lines | traceback | first line |", "| --- | --- | --- | --- | --- |",
                  *rows, ""]
        # convert --force --out LINK
        target = os.path.join(d, "store", "current")
        shutil.copytree(folder, target)
        link = os.path.join(d, "links", "current")
        os.makedirs(os.path.dirname(link))
        os.symlink(target, link)
        rc, first, _, tb = cli("convert", src, "--model", "vit3_tiny.digits", "--model-args", json.dumps(SMALL),
                               "--out", link, "--no-flops", "--force")
        left = [p for q in (os.path.dirname(link), os.path.dirname(target)) for p in os.listdir(q) if ".partial-" in p]
        lines += ["## `convert --force --out LINK`", "",
                  f"exit {rc}, traceback {'yes' if tb else 'no'}; the link is still a link: {os.path.islink(link)} "
                  f"(to the same target: {os.readlink(link) == target}); its target a real folder: "
                  f"{os.path.isdir(target) and not os.path.islink(target)}; `.partial-*` left: {len(left)}; the "
                  f"target loads: {type(hub.load_folder(link)).__name__}.", ""]
    atomic_write(args.out, "\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
