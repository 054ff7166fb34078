"""The run folder's one owner (issue 36, items 0, 1, 2, 3, 6): the grep counts, a resume of best.state.pt on a run
whose best is not its last (refused, the folder byte-identical), and every reader given a run file with one byte
of its weights flipped (refused in one line), each through the command line in a subprocess.

    python experiments/run_folder_table.py [--out experiments/results/run_folder.md]

The kills before the first commit (SIGKILL, SIGTERM; then the same command or --resume) are the tests
``tests/test_epoch_commit.py::test_stopped_before_the_first_commit_*`` and the signals ``tests/test_train_signals.py``.
"""
import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
ENV = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
TINY = ["--model", "vit3_tiny", "--model-kwargs", "depth=1", "embed_dim=16", "num_heads=2", "patch_size=4",
        "--img-size", "16", "--workers", "0", "--opt", "sgd", "--lr", "0.5", "--warmup-epochs", "0",
        "--val-split", "val", "--log-interval", "100", "-b", "16", "--epochs", "3", "--model-ema",
        "--model-ema-decay", "0.5"]
KW = ["--model-kwargs", "depth=1", "embed_dim=16", "num_heads=2", "patch_size=4", "img_size=16"]
NAMES = r'"(last|best)(_ema)?\.(state\.pt|safetensors)"|"checkpoint\.json"|"summary\.csv"|"args\.yaml"|' \
        r'"log\.txt"|"train_plot\.png"|args\.resume-epoch'


def ttt_zoo(*argv):
    p = subprocess.run([sys.executable, "-m", "ttt_zoo", *map(str, argv)], cwd=ROOT, env=ENV, capture_output=True,
                       text=True)
    return p.returncode, (p.stderr.strip().splitlines() or [""])[-1], p.stderr


def contents(folder):
    return {n: hashlib.sha256(open(os.path.join(folder, n), "rb").read()).hexdigest()
            for n in sorted(os.listdir(folder))}


def grep(pattern, skip=()):
    hits = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "ttt_zoo")):
        for f in files:
            path = os.path.join(dirpath, f)
            if not f.endswith(".py") or os.path.relpath(path, ROOT) in skip:
                continue
            for i, line in enumerate(open(path), 1):
                if re.search(pattern, line):
                    hits.append(f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()}")
    return hits


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "experiments", "results", "run_folder.md"))
    out = ap.parse_args().out
    from _train_data import make_tiny_digits
    lines = ["# The run folder's one owner (issue 36 items 0, 1, 2, 3, 6)", "",
             "Written by `python experiments/run_folder_table.py`.", "", "## grep counts", ""]
    resolvers = grep(r"def resolve_checkpoint|_FROM_RUN|def load_run_args|def find_weights|def _recorded_args")
    callers = grep(r"resolve_checkpoint\(")
    literals = grep(NAMES, skip=("ttt_zoo/run_folder.py",))
    pause = grep(r"TTT_ZOO_TEST_SAVE_PAUSE|_test_pause|SAVE_PAUSED")
    lines += [f"- `--checkpoint` resolvers and run-argument tables (`def resolve_checkpoint|_FROM_RUN|def "
              f"load_run_args|def find_weights|def _recorded_args` in ttt_zoo/): {len(resolvers)}",
              *[f"  - {h}" for h in resolvers],
              f"- calls of the resolver: {len(callers)}", *[f"  - {h}" for h in callers],
              f"- run-folder file-name literals outside ttt_zoo/run_folder.py: {len(literals)}",
              *[f"  - {h}" for h in literals],
              f"- test pauses in the package (`TTT_ZOO_TEST_SAVE_PAUSE|_test_pause|SAVE_PAUSED`): {len(pause)}", ""]

    tmp = tempfile.mkdtemp(prefix="run_folder_table-")
    try:
        data = make_tiny_digits(os.path.join(tmp, "digits"))
        rc, last, err = ttt_zoo("train", "--data-dir", data, "--output", os.path.join(tmp, "runs"), *TINY,
                                "--experiment", "r", "--stop-after", "2")
        assert rc == 0, err[-3000:]
        run = os.path.join(tmp, "runs", "r")
        import json
        manifest = json.load(open(os.path.join(run, "checkpoint.json")))
        lines += ["## 1. `--resume RUN/best.state.pt` on a run whose best is not its last", "",
                  f"checkpoint.json: epoch {manifest['epoch']}, best_epoch {manifest['best_epoch']} (0-based: best.* "
                  f"is epoch {manifest['best_epoch'] + 1})", ""]
        before = contents(run)
        rc, line, _ = ttt_zoo("train", "--data-dir", data, "--output", os.path.join(tmp, "runs"), *TINY,
                              "--resume", os.path.join(run, "best.state.pt"))
        after = contents(run)
        lines += [f"exit {rc}: `{line.replace(tmp, '$TMP')}`", "",
                  f"folder byte-identical before and after (names + sha256 of {len(before)} files): "
                  f"{'yes' if before == after else 'NO'}", "", "| file | sha256 before | after |", "|---|---|---|",
                  *[f"| {n} | {before[n][:16]} | {after.get(n, 'missing')[:16]} |" for n in before], ""]

        best = os.path.join(run, "best.safetensors")
        raw = bytearray(open(best, "rb").read())
        n = int.from_bytes(raw[:8], "little")
        raw[8 + n + (len(raw) - 8 - n) // 2] ^= 1
        open(best, "wb").write(bytes(raw))
        image = os.path.join(data, "val", "3", sorted(os.listdir(os.path.join(data, "val", "3")))[0])
        readers = {
            "validate": ["validate", "--checkpoint", best, "--workers", 0, "--device", "cpu"],
            "predict": ["predict", image, "--checkpoint", best, "--workers", 0, "--device", "cpu"],
            "sample (a classifier's file: refused before the model)": ["sample", "--checkpoint", best, "--model",
                                                                       "dit_s_2", "--out", f"{tmp}/s.png"],
            "attention-map": ["attention-map", "--model", "vit3_tiny", *KW, "--checkpoint", best, "--query-pixel", 4,
                              4, "--image", image, "--out", f"{tmp}/a.png"],
            "export": ["export", "--model", "vit3_tiny", *KW, "--checkpoint", best, "--out", f"{tmp}/m.onnx"],
            "convert": ["convert", best, "--model", "vit3_tiny.digits", *KW, "--out", f"{tmp}/hub", "--no-flops"],
            "train --initial-checkpoint": ["train", "--data-dir", data, "--output", f"{tmp}/runs2", *TINY,
                                           "--initial-checkpoint", best, "--experiment", "new"],
        }
        lines += ["## 6. one byte of best.safetensors' data flipped: every reader", "",
                  "| command | exit | stderr lines | the line |", "|---|---|---|---|"]
        for what, argv in readers.items():
            rc, line, err = ttt_zoo(*argv)
            lines.append(f"| {what} | {rc} | {len(err.strip().splitlines())} | {line.replace(tmp, '$TMP')} |")
        lines.append("")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
