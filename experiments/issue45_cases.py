"""Every case of issue 45 ("a run folder is a contract"), each a scripted scenario run against a checkout: exit
status, the first line (as ``issue36_cases.line_of``), the run folder's bytes before/after where data was at risk,
the facts the issue asks for, and a verdict by a rule written per case.  Run on a worktree of 299558e (before) and on
the working tree (after):

    git worktree add /tmp/E45/before 299558e
    python experiments/issue45_cases.py --tree /tmp/E45/before --label before --json /tmp/E45/before.json
    python experiments/issue45_cases.py --tree . --label after --json /tmp/E45/after.json
    python experiments/issue45_cases.py --table /tmp/E45/before.json /tmp/E45/after.json   # -> experiments/results/

Each command runs as ``PYTHONPATH=TREE python -m ttt_zoo ...`` (this interpreter), one thread, offline, umask 022,
in a scratch folder with fixtures made by the same tree: a tiny digits folder whose classes are named (zero ... nine,
so the run's sorted class order is not the digits' order), a 2-epoch vit3_tiny run RUN, a run stopped after 1 of 4
epochs, a tiny DeiT (timm's deit_tiny_patch16_224 at 16 px, depth 1, width 16) for ``--linearize-from``, weights that
are all NaN / stored as int32 / with a transposed head, a Hub folder made by the tree's own ``convert`` and then
damaged.  Where data was at risk the sha256 of every file of the run folder is compared before and after
("identical" / "CHANGED: names").  A Ctrl-C is a real SIGINT the process sends itself at its first module call; a
killed export is a SIGKILL the process sends itself just before it renames its ``.tmp-*.onnx`` onto ``--out``;
memory cases run under RLIMIT_AS 10 GiB so that an allocation fails instead of the machine swapping.
"""
import argparse
import glob
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))
from issue36_cases import line_of  # noqa: E402  (the first line, exactly as issue 36's table takes it)

OUT = os.path.join(ROOT, "experiments", "results", "issue45_cases")
PY = sys.executable
KW = ["depth=1", "embed_dim=16", "num_heads=2", "patch_size=4"]
NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
TRAIN_FLAGS = ["--img-size", "16", "--workers", "0", "--opt", "sgd", "--lr", "0.05", "--warmup-epochs", "0",
               "--log-interval", "100", "-b", "16", "--seed", "0"]
TINY = ["--model", "vit3_tiny", "--model-kwargs", *KW, *TRAIN_FLAGS]
MEM_LIMIT = 10 << 30


class SetupFailed(Exception):
    pass


class Ctx:
    def __init__(self, tree: str, work: str):
        self.tree, self.work = os.path.abspath(tree), work
        self.env = dict(os.environ, PYTHONPATH=self.tree, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
                        PYTHONDONTWRITEBYTECODE="1")
        self.cache = {}
        self.n = 0  # scratch names

    def p(self, *parts):
        return os.path.join(self.work, *parts)

    @staticmethod
    def _preexec(mem=False):
        def f():
            os.umask(0o022)
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # as from a terminal (Python then installs its handler)
            if mem:
                import resource
                resource.setrlimit(resource.RLIMIT_AS, (MEM_LIMIT, MEM_LIMIT))
        return f

    def run(self, *argv, timeout=300, cwd=None, mem=False, code=None):
        """``python -m ttt_zoo ARGV`` (or ``python -c CODE ARGV``, CODE ending in the CLI's main) in the tree."""
        cmd = [PY, "-m", "ttt_zoo"] if code is None else [PY, "-c", code]
        t0 = time.time()
        try:
            proc = subprocess.run([*cmd, *map(str, argv)], cwd=cwd or self.work, env=self.env, capture_output=True,
                                  timeout=timeout, preexec_fn=self._preexec(mem))
            r = dict(rc=proc.returncode, out=_text(proc.stdout), err=_text(proc.stderr))
        except subprocess.TimeoutExpired as e:  # still working: stopped here, shown as such
            r = dict(rc=f"killed after {timeout} s", out=_text(e.stdout), err=_text(e.stderr))
        r["s"] = round(time.time() - t0, 1)
        return r

    def py(self, code, timeout=300):
        return self.run(timeout=timeout, code=code)

    def train(self, *extra, data=None, name):
        return ["train", "--data-dir", data or self.p("digits"), "--output", self.p("runs"), "--experiment", name,
                *TINY, *extra]

    def model_args(self, weights):
        return ["--model", "vit3_tiny", "--checkpoint", weights, "--model-kwargs", *KW, "--img-size", "16",
                "--num-classes", "10", "-j", "0"]


def _text(b):
    if b is None:
        return ""
    return b.decode("utf-8", "backslashreplace") if isinstance(b, bytes) else b


# ----- fixtures (made by the tree under test) -----

FIXTURES = r'''
import os, sys, json, numpy as np, torch, timm, ttt_zoo
from PIL import Image
from sklearn.datasets import load_digits
from safetensors.torch import save_file
NAMES = %r
d = load_digits()
def png(i, path):
    img = Image.fromarray((d.images[i] * 255 / 16).astype(np.uint8)).resize((16, 16), Image.BICUBIC)
    img.convert("RGB").save(path)
for c in range(10):
    idx = np.flatnonzero(d.target == c)
    for split, ids in (("train", idx[:10]), ("val", idx[10:16])):
        os.makedirs(f"digits/{split}/{NAMES[c]}", exist_ok=True)
        for i in ids:
            png(i, f"digits/{split}/{NAMES[c]}/{i:04d}.png")
# other data: other class names (letters), same image size
for c, name in enumerate("abcdefghij"):  # 10 classes, as RUN's, under other names
    idx = np.flatnonzero(d.target == c)
    for split, ids in (("train", idx[20:23]), ("val", idx[23:25])):
        os.makedirs(f"letters/{split}/{name}", exist_ok=True)
        for i in ids:
            png(i, f"letters/{split}/{name}/{i:04d}.png")
os.makedirs("imgs", exist_ok=True)
png(7, "imgs/seven.png")
os.makedirs("imgs_bad", exist_ok=True)
png(7, os.fsencode("imgs_bad/") + b"bad\xff.png")
torch.manual_seed(0)
m = timm.create_model("vit3_tiny", img_size=16, num_classes=10, depth=1, embed_dim=16, num_heads=2, patch_size=4)
sd = m.state_dict()
save_file(sd, "good.safetensors")
save_file({k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in sd.items()},
          "nan_all.safetensors")
save_file({k: (v * 1000).round().to(torch.int32) if v.is_floating_point() else v for k, v in sd.items()},
          "int32.safetensors")
t = {k: v.clone() for k, v in sd.items()}
t["head.weight"] = t["head.weight"].t().contiguous()
save_file(t, "transposed.safetensors")
deit = timm.create_model("deit_tiny_patch16_224", img_size=16, patch_size=4, depth=1, embed_dim=16, num_heads=2,
                         num_classes=10)
save_file(deit.state_dict(), "deit.safetensors")
''' % (NAMES,)


def make_fixtures(c: Ctx) -> dict:
    t0 = time.time()
    r = c.py(FIXTURES)
    assert r["rc"] == 0, r["err"][-3000:]
    shutil.copytree(c.p("digits"), c.p("data_r"))  # RUN's own data (W: renamed class folders, then put back)
    steps = {
        "RUN (2 epochs)": c.train("--epochs", "2", data=c.p("data_r"), name="r"),
        "RUN4 (--epochs 4 --stop-after 1)": c.train("--epochs", "4", "--stop-after", "1", name="r4"),
        "REL (relative --data-dir, --epochs 3 --stop-after 1)":
            ["train", "--data-dir", "digits", "--output", c.p("runs"), "--experiment", "rel", *TINY, "--epochs", "3",
             "--stop-after", "1"],
        "HUB (convert good.safetensors)":
            ["convert", c.p("good.safetensors"), "--model", "vit3_tiny.cases", "--model-kwargs", *KW, "img_size=16",
             "num_classes=10", "--out", c.p("hub_good"), "--no-flops"],
    }
    times = {}
    for what, argv in steps.items():
        r = c.run(*argv)
        assert r["rc"] == 0, f"{what}: {r['err'][-3000:]}"
        times[what] = r["s"]
    times["total"] = round(time.time() - t0, 1)
    return times


# ----- helpers -----

def _copy(c, src, name):
    dst = c.p(name)
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(c.p(src), dst, symlinks=True)
    return dst


def _flip(path):
    """Flip one byte in the data section of a safetensors file (after its JSON header)."""
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        f.seek(8 + n + 64)
        b = f.read(1)
        f.seek(8 + n + 64)
        f.write(bytes([b[0] ^ 0x40]))


def _tree_hash(folder):
    h = {}
    for r, _, fs in os.walk(folder):
        for f in sorted(fs):
            p = os.path.join(r, f)
            try:
                h[os.path.relpath(p, folder)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
            except OSError as e:
                h[os.path.relpath(p, folder)] = f"unreadable: {e}"
    return h


def _compare(before, after):
    changed = sorted(n for n in set(before) | set(after) if before.get(n) != after.get(n))
    if not changed:
        return "identical"
    tags = [n + (" (new)" if n not in before else " (gone)" if n not in after else "") for n in changed]
    return "CHANGED: " + ", ".join(tags)


def _hub_with(c, name, edit):
    dst = _copy(c, "hub_good", name)
    path = os.path.join(dst, "config.json")
    cfg = json.load(open(path))
    edit(cfg)
    json.dump(cfg, open(path, "w"))
    return dst


def _summary(folder):
    import csv
    try:
        with open(os.path.join(folder, "summary.csv")) as f:
            return list(csv.DictReader(f))
    except OSError:
        return []


def _lrs(folder):
    out = []
    for row in _summary(folder):
        try:
            out.append((int(float(row.get("epoch"))), float(row.get("lr"))))
        except (TypeError, ValueError):
            pass
    return out


def _recorded(folder):
    """What the run records: args.yaml (updated by each args.resume-epoch*.yaml) and run.json where there is one."""
    import yaml
    args = {}
    for name in ["args.yaml"] + sorted(n for n in os.listdir(folder) if n.startswith("args.resume-epoch")):
        try:
            args.update(yaml.safe_load(open(os.path.join(folder, name))) or {})
        except (OSError, ValueError):
            pass
    run = None
    if os.path.isfile(os.path.join(folder, "run.json")):
        try:
            run = json.load(open(os.path.join(folder, "run.json")))
        except (OSError, ValueError):
            run = None
    return args, run


def _find_key(obj, key):
    """Every value of ``key`` anywhere in a nested dict / list."""
    out = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == key:
                out.append(v)
            out += _find_key(v, key)
    elif isinstance(obj, list):
        for v in obj:
            out += _find_key(v, key)
    return out


def _oneline(r):
    """A clear refusal: exit 2, no traceback, exactly one ``error`` line on stderr."""
    errs = [ln for ln in r["err"].splitlines() if ln.startswith("error")]
    return r["rc"] == 2 and "Traceback" not in r["err"] and len(errs) == 1


def _ok0(r):
    return r["rc"] == 0 and "Traceback" not in r["err"]


def _stale(folder, pattern=".tmp-*"):
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(folder, pattern)))


def _hub_of_run(c):
    """RUN converted to a Hub folder (cached): without --model where the tree takes the model from the run, else
    with --model vit3_tiny.r (the run's own model)."""
    if "hub_r" not in c.cache:
        out = c.p("hub_r")
        shutil.rmtree(out, ignore_errors=True)
        r = c.run("convert", c.p("runs", "r"), "--tag", "r", "--out", out, "--no-flops")
        how = "convert RUN --tag r"
        if r["rc"] != 0:
            r = c.run("convert", c.p("runs", "r"), "--model", "vit3_tiny.r", "--out", out, "--no-flops")
            how = "convert RUN --model vit3_tiny.r"
        c.cache["hub_r"] = (out if r["rc"] == 0 else None, how, r)
    return c.cache["hub_r"]


def _predictions(c):
    """RUN's top-1 class index for every image of digits/val (cached), by file path."""
    if "pred" not in c.cache:
        r = c.run("predict", c.p("digits", "val"), "--checkpoint", c.p("runs", "r"), "--label-type", "index",
                  "--fullname", "-j", "0")
        if r["rc"] != 0:
            raise SetupFailed(f"predict digits/val: {line_of(r['err'], r['rc'])}")
        got = json.loads(r["out"])
        c.cache["pred"] = {os.path.realpath(k): int(v["index"]) for k, v in got.items()}
    return c.cache["pred"]


def _expected_top1(c, folder):
    """Top-1 (%) of RUN's predictions on the images in ``folder``/val, each against its class folder's name."""
    pred = _predictions(c)
    order = sorted(NAMES)  # the run's class order: its training folders, sorted
    ok = n = 0
    for cls in os.listdir(os.path.join(folder, "val")):
        for f in os.listdir(os.path.join(folder, "val", cls)):
            src = os.path.realpath(c.p("digits", "val", cls, f))
            n += 1
            ok += pred[src] == order.index(cls)
    return 100.0 * ok / n, n


def _top1(out):
    m = re.search(r"top1 ([\d.]+)", out)
    return float(m.group(1)) if m else None


# ----- the cases: scenario(ctx) -> dict(r=result, ok=bool, note=str, bytes=str|None) -----

def _at_risk(run_src, argv_of):
    """A command with an output into a copy of RUN: the copy's bytes before and after."""
    def f(c):
        c.n += 1
        run = _copy(c, run_src, f"risk_{os.path.basename(run_src)}_{c.n}")
        before = _tree_hash(run)
        r = c.run(*argv_of(c, run))
        cmp = _compare(before, _tree_hash(run) if os.path.isdir(run) else {})
        return dict(r=r, ok=_oneline(r) and cmp == "identical", bytes=cmp)
    return f


def c_convert_live(c):
    """convert --out RUN --force while a train holds RUN's lock (the trainer stopped with SIGSTOP meanwhile)."""
    name = "live"
    run = c.p("runs", name)
    shutil.rmtree(run, ignore_errors=True)
    proc = subprocess.Popen([PY, "-m", "ttt_zoo", *c.train("--epochs", "500", name=name)], cwd=c.work, env=c.env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=c._preexec())
    try:
        t0 = time.time()
        while time.time() - t0 < 180 and not os.path.exists(os.path.join(run, "checkpoint.json")):
            if proc.poll() is not None:
                raise SetupFailed(f"the train exited ({proc.returncode}) before its first commit")
            time.sleep(0.1)
        if not os.path.exists(os.path.join(run, "checkpoint.json")):
            raise SetupFailed("no commit within 180 s")
        proc.send_signal(signal.SIGSTOP)
        time.sleep(0.5)
        lock = os.path.join(run, ".ttt-zoo.lock")
        ino = (os.stat(run).st_ino, os.stat(lock).st_ino if os.path.exists(lock) else None)
        before = _tree_hash(run)
        r = c.run("convert", c.p("good.safetensors"), "--model", "vit3_tiny.live", "--model-kwargs", *KW,
                  "img_size=16", "num_classes=10", "--out", run, "--force", "--no-flops")
        after = _tree_hash(run) if os.path.isdir(run) else {}
        ino2 = (os.stat(run).st_ino if os.path.isdir(run) else None,
                os.stat(lock).st_ino if os.path.exists(lock) else None)
    finally:
        try:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        except ProcessLookupError:
            pass
        proc.wait()
    cmp = _compare(before, after)
    same = ino == ino2
    note = ("the folder and its lock file are the same inodes" if same else
            f"folder inode {'same' if ino[0] == ino2[0] else 'REPLACED'}, lock file "
            f"{'same' if ino[1] == ino2[1] else 'missing' if ino2[1] is None else 'REPLACED (a plain copy)'}")
    return dict(r=r, ok=_oneline(r) and cmp == "identical" and same, bytes=cmp, note=note)


def _t5(c):
    """The T5 run: train --linearize-from deit_tiny_patch16_224 --initial-checkpoint (cached)."""
    if "t5" not in c.cache:
        shutil.rmtree(c.p("runs", "t5"), ignore_errors=True)
        r = c.run("train", "--data-dir", c.p("digits"), "--output", c.p("runs"), "--experiment", "t5",
                  "--linearize-from", "deit_tiny_patch16_224", "--initial-checkpoint", c.p("deit.safetensors"),
                  "--model-kwargs", "img_size=16", "patch_size=4", "depth=1", "embed_dim=16", "num_heads=2",
                  *TRAIN_FLAGS, "--epochs", "1")
        c.cache["t5"] = r
    return c.cache["t5"], c.p("runs", "t5")


def _need_t5(c):
    r, run = _t5(c)
    if r["rc"] != 0:
        raise SetupFailed(f"the T5 run failed: {line_of(r['err'], r['rc'])}")
    return run


def c_t5_train(c):
    r, run = _t5(c)
    if r["rc"] != 0:
        return dict(r=r, ok=False)
    args, rec = _recorded(run)
    models = [m for m in _find_key(rec, "model") if isinstance(m, str)] if rec else []
    note = f"args.yaml model: {args.get('model')!r}, linearize_from: {args.get('linearize_from')!r}"
    if rec is not None:
        note += f"; run.json model: {models[0] if models else None!r}"
    ok = _ok0(r) and any(isinstance(m, str) and m.startswith("t5") for m in models + [args.get("model")])
    return dict(r=r, ok=ok, note=note)


def c_t5_cmd(kind):
    def f(c):
        run = _need_t5(c)
        if kind == "validate":
            r = c.run("validate", "--checkpoint", run, "-j", "0")
            return dict(r=r, ok=_ok0(r), note=f"top1 {_top1(r['out'])}" if r["rc"] == 0 else "")
        if kind == "predict":
            r = c.run("predict", c.p("imgs", "seven.png"), "--checkpoint", run, "-j", "0")
            return dict(r=r, ok=_ok0(r), note=r["out"].strip()[:120] if r["rc"] == 0 else "")
        if kind == "export":
            out = c.p("t5.onnx")
            r = c.run("export", "--checkpoint", run, "--out", out, "--force")
            return dict(r=r, ok=_ok0(r) and os.path.isfile(out))
        if kind == "attention-map":
            out = c.p("t5_map.png")
            r = c.run("attention-map", "--checkpoint", run, "--query-pixel", "4", "4", "--out", out, "--force")
            return dict(r=r, ok=_ok0(r) and os.path.isfile(out))
        if kind == "push":
            hub = c.p("hub_t5")
            shutil.rmtree(hub, ignore_errors=True)
            conv = c.run("convert", run, "--tag", "lin", "--out", hub, "--no-flops")
            if conv["rc"] != 0:
                return dict(r=conv, ok=False, note="the convert of the T5 run (convert RUN --tag lin, no --model) "
                                                   "failed; the line is convert's")
            r = c.run("push", hub, "--source", run, "--dry-run")
            return dict(r=r, ok=_ok0(r), note="convert RUN --tag lin: exit 0")
        raise AssertionError(kind)
    return f


def c_export_run(with_model):
    def f(c):
        out = c.p(f"run_{int(with_model)}.onnx")
        argv = ["export", "--checkpoint", c.p("runs", "r"), "--out", out, "--force"]
        if with_model:
            argv += ["--model", "vit3_tiny"]
        r = c.run(*argv)
        note = ""
        if r["rc"] == 0 and os.path.isfile(out):
            try:
                import onnx
                dims = [d.dim_value or d.dim_param for d in
                        onnx.load(out, load_external_data=False).graph.output[0].type.tensor_type.shape.dim]
                note = f"ONNX output dims {dims}"
                return dict(r=r, ok=_ok0(r) and 10 in dims, note=note)
            except Exception as e:  # noqa: BLE001
                note = f"ONNX not read ({type(e).__name__})"
        return dict(r=r, ok=_ok0(r) and os.path.isfile(out), note=note)
    return f


def c_attn_run(with_model):
    def f(c):
        out = c.p(f"map_{int(with_model)}.png")
        argv = ["attention-map", "--checkpoint", c.p("runs", "r"), "--query-pixel", "4", "4", "--out", out, "--force"]
        if with_model:
            argv += ["--model", "vit3_tiny"]
        r = c.run(*argv)
        grids = sorted(set(re.findall(r"of \((\d+, \d+)\)\)", r["out"])))
        note = f"token grid mapped: {', '.join(grids) or '?'} (the run's 16 px / patch 4: 4, 4)"
        return dict(r=r, ok=_ok0(r) and grids == ["4, 4"], note=note)
    return f


def c_push_run(c):
    hub, how, conv = _hub_of_run(c)
    if hub is None:
        raise SetupFailed(f"{how}: {line_of(conv['err'], conv['rc'])}")
    r = c.run("push", hub, "--source", c.p("runs", "r"), "--dry-run")
    return dict(r=r, ok=_ok0(r), note=f"folder by `{how}`")


def c_resume_epochs(c):
    run = _copy(c, os.path.join("runs", "r"), "res_epochs")
    r = c.run("train", "--resume", run, "--epochs", "4")
    lrs = _lrs(run)
    note = "summary.csv lr by epoch: " + ", ".join(f"{e}: {lr:.4g}" for e, lr in lrs)
    later = [lr for _, lr in lrs[2:]]  # the rows after the first run's two (epochs count from 0 or 1)
    ok = _ok0(r) and len(later) == 2 and all(lr > 1e-6 for lr in later)
    return dict(r=r, ok=ok, note=note, facts=dict(lr=lrs))


def c_resume_lr(c):
    run = _copy(c, os.path.join("runs", "r4"), "res_lr")
    r = c.run("train", "--resume", run, "--lr", "0.5")
    lrs = _lrs(run)
    args, rec = _recorded(run)
    rec_lr = [v for v in _find_key(rec, "lr")] if rec else []
    note = ("summary.csv lr by epoch: " + ", ".join(f"{e}: {lr:.4g}" for e, lr in lrs) +
            f"; args record lr {args.get('lr')}" + (f", run.json lr {rec_lr[-1]}" if rec_lr else ""))
    later = [lr for _, lr in lrs[1:]]  # the rows after RUN4's first epoch
    applied = _ok0(r) and later and later[0] > 0.05  # cosine never exceeds its base: above 0.05 = 0.5 is used
    return dict(r=r, ok=_oneline(r) or bool(applied), note=note, facts=dict(lr=lrs))


def c_resume_data(which):
    def f(c):
        run = _copy(c, os.path.join("runs", "r4"), "res_data_" + which)
        before = _tree_hash(run)
        if which == "other":
            data = c.p("letters")
        else:
            data = c.p("digits_moved")
            if not os.path.isdir(data):
                shutil.copytree(c.p("digits"), data)
        r = c.run("train", "--resume", run, "--data-dir", data)
        text = r["out"] + r["err"]
        if which == "other":
            cmp = _compare(before, _tree_hash(run))
            return dict(r=r, ok=_oneline(r) and cmp == "identical", bytes=cmp)
        said = [ln.strip() for ln in text.splitlines() if "digits_moved" in ln and "Traceback" not in ln]
        note = f"said: {said[0][:160]}" if said else "the new folder is not named in the output"
        return dict(r=r, ok=_ok0(r) and bool(said), note=note)
    return f


AUDIT_DATA = r'''
import os, sys
seen = set()
def hook(event, args):
    if event == "open" and isinstance(args[0], (str, bytes)):
        p = os.fsdecode(args[0])
        if os.path.abspath(p).startswith(WATCH):
            seen.add(p)
    elif event in ("os.listdir", "os.scandir") and args and isinstance(args[0], (str, bytes)):
        if os.path.abspath(os.fsdecode(args[0])).startswith(WATCH):
            seen.add(os.fsdecode(args[0]))
sys.addaudithook(hook)
import atexit
atexit.register(lambda: open(REPORT, "w").write(str(len(seen))))
from ttt_zoo.cli import main
sys.exit(main(sys.argv[1:]))
'''


def c_resume_relative(other_data):
    def f(c):
        run = _copy(c, os.path.join("runs", "rel"), "res_rel_" + str(int(other_data)))
        cwd = c.p("elsewhere_" + str(int(other_data)))
        shutil.rmtree(cwd, ignore_errors=True)
        os.makedirs(cwd)
        if other_data:
            shutil.copytree(c.p("letters"), os.path.join(cwd, "digits"))
        report = os.path.join(c.work, f"rel_report_{int(other_data)}.txt")
        code = (f"WATCH = {os.path.join(cwd, 'digits')!r}\nREPORT = {report!r}\n" + AUDIT_DATA)
        r = c.run("train", "--resume", run, cwd=cwd, code=code)
        read = int(open(report).read()) if os.path.exists(report) else None
        note = (f"files read from {os.path.basename(cwd)}/digits (other classes): {read}" if other_data else
                "no `digits` folder in the current folder")
        ok = _ok0(r) and (read == 0 if other_data else True)
        return dict(r=r, ok=ok, note=note)
    return f


def c_validate_subset(kind):
    def f(c):
        data = c.p("val_" + kind)
        shutil.rmtree(data, ignore_errors=True)
        shutil.copytree(c.p("digits"), data)
        if kind == "missing":
            shutil.rmtree(os.path.join(data, "val", "three"))
        else:  # an empty class folder
            for n in os.listdir(os.path.join(data, "val", "three")):
                os.remove(os.path.join(data, "val", "three", n))
        want, n = _expected_top1(c, data)
        r = c.run("validate", "--checkpoint", c.p("runs", "r"), "--data-dir", data, "--split", "val", "-j", "0")
        got = _top1(r["out"])
        note = f"validate top1 {got}; RUN's per-image predictions against each image's class name: {want:.3f} " \
               f"({n} images)"
        if r["rc"] != 0:  # what a user then tries: the run's number of classes given by hand
            r2 = c.run("validate", "--checkpoint", c.p("runs", "r"), "--data-dir", data, "--split", "val", "-j", "0",
                       "--num-classes", "10")
            note += f"; with --num-classes 10: exit {r2['rc']}, top1 {_top1(r2['out'])}"
        line = line_of(r["err"], r["rc"])
        ok = (_ok0(r) and got is not None and abs(got - want) < 0.01) or (
            kind == "empty" and _oneline(r) and ("three" in line or "empty" in line.lower()))
        return dict(r=r, ok=ok, note=note)
    return f


def c_train_bad_class(kind):
    def f(c):
        data = c.p("bad_" + kind)
        shutil.rmtree(data, ignore_errors=True)
        shutil.copytree(c.p("digits"), data)
        if kind == "empty":
            for n in os.listdir(os.path.join(data, "train", "three")):
                os.remove(os.path.join(data, "train", "three", n))
        else:  # a stray folder (no images) that sorts first
            os.makedirs(os.path.join(data, "train", "aa_stray"))
            open(os.path.join(data, "train", "aa_stray", "notes.txt"), "w").write("not a class\n")
        name = "bad_" + kind
        shutil.rmtree(c.p("runs", name), ignore_errors=True)
        r = c.run(*c.train("--epochs", "2", data=data, name=name))
        committed = os.path.exists(c.p("runs", name, "checkpoint.json"))
        note = "an epoch was committed" if committed else "nothing committed"
        return dict(r=r, ok=_oneline(r) and not committed, note=note)
    return f


def c_predict_renamed(c):
    """RUN's data folder has its class folders renamed (upper case) after training: predict labels with?"""
    train = c.p("data_r", "train")
    moved = []
    try:
        for n in NAMES:
            os.rename(os.path.join(train, n), os.path.join(train, n.upper()))
            moved.append(n)
        r = c.run("predict", c.p("digits", "val"), "--checkpoint", c.p("runs", "r"), "--label-type", "name",
                  "--topk", "3", "-j", "0")
    finally:
        for n in moved:
            os.rename(os.path.join(train, n.upper()), os.path.join(train, n))
    labels = set()
    if r["rc"] == 0:
        for v in json.loads(r["out"]).values():
            lab = v.get("label")
            labels.update(lab if isinstance(lab, list) else [lab])
    note = f"labels used: {sorted(map(str, labels))[:6]}"
    return dict(r=r, ok=_ok0(r) and bool(labels) and labels <= set(NAMES), note=note)


def c_convert_names(c):
    hub, how, conv = _hub_of_run(c)
    if hub is None:
        return dict(r=conv, ok=False, note=f"{how} failed")
    cfg = json.load(open(os.path.join(hub, "config.json")))
    names = cfg.get("label_names")
    r = c.run("predict", c.p("digits", "val", "seven"), "--checkpoint", hub, "--label-type", "name", "-j", "0")
    labels = set()
    if r["rc"] == 0:
        for v in json.loads(r["out"]).values():
            lab = v.get("label")
            labels.update(lab if isinstance(lab, list) else [lab])
    note = f"`{how}`; config.json label_names: {names if names is None else names[:3] + ['...']}; predict labels: " \
           f"{sorted(map(str, labels))[:4]}"
    return dict(r=r, ok=_ok0(r) and names == sorted(NAMES) and bool(labels) and labels <= set(NAMES), note=note)


def c_link_outside(c):
    run = _copy(c, os.path.join("runs", "r"), "r_linked")
    _flip(os.path.join(run, "best.safetensors"))
    link = c.p("link_best.safetensors")
    if os.path.lexists(link):
        os.remove(link)
    os.symlink(os.path.join(run, "best.safetensors"), link)
    r = c.run("validate", "--data-dir", c.p("digits"), "--split", "val", *c.model_args(link))
    return dict(r=r, ok=_oneline(r), note="link_best.safetensors -> RUN/best.safetensors, one byte flipped")


def _no_manifest_run(c, name):
    run = _copy(c, os.path.join("runs", "r"), name)
    _flip(os.path.join(run, "best.safetensors"))
    os.remove(os.path.join(run, "checkpoint.json"))
    return run


def c_no_manifest_validate(c):
    run = _no_manifest_run(c, "r_nomani_v")
    r = c.run("validate", "--checkpoint", run, "-j", "0")
    return dict(r=r, ok=_oneline(r) and "checkpoint.json" in line_of(r["err"], r["rc"]),
                note="best.safetensors one byte flipped, checkpoint.json deleted")


def c_no_manifest_convert(c):
    run = _no_manifest_run(c, "r_nomani_c")
    out = c.p("hub_laundered")
    shutil.rmtree(out, ignore_errors=True)
    r = c.run("convert", run, "--model", "vit3_tiny.laundered", "--out", out, "--no-flops")
    note = "a Hub folder was written" if os.path.isdir(out) else "no Hub folder written"
    return dict(r=r, ok=_oneline(r) and not os.path.isdir(out), note=note)


def c_convert_weights(fname):
    def f(c):
        out = c.p("hub_" + fname.split(".")[0])
        shutil.rmtree(out, ignore_errors=True)
        r = c.run("convert", c.p(fname), "--model", "vit3_tiny.bad", "--model-kwargs", *KW, "img_size=16",
                  "num_classes=10", "--out", out, "--no-flops")
        note = "a Hub folder was written" if os.path.isdir(out) else "no Hub folder written"
        return dict(r=r, ok=_oneline(r) and not os.path.isdir(out), note=note)
    return f


def c_convert_std(c):
    out = c.p("hub_std_out")
    shutil.rmtree(out, ignore_errors=True)
    tiny = ("--model-args", json.dumps(dict(depth=1, embed_dim=16, num_heads=2, patch_size=4, img_size=16,
                                            num_classes=10, pretrained_cfg=dict(mean=[1e-300] * 3, std=[1e-300] * 3))))
    r = c.run("convert", c.p("good.safetensors"), "--model", "vit3_tiny.std", *tiny, "--out", out, "--no-flops")
    note = ""
    if os.path.isfile(os.path.join(out, "config.json")):
        pc = json.load(open(os.path.join(out, "config.json"))).get("pretrained_cfg", {})
        note = f"written config.json: mean {pc.get('mean')}, std {pc.get('std')}"
    else:
        note = "no config.json written"
    return dict(r=r, ok=_oneline(r) and not os.path.isdir(out), note=note)


CREATE = r'''
import sys, timm, ttt_zoo
kw = dict(img_size=16, patch_size=4, embed_dim=16, num_heads=2, depth=1, num_classes=10)
kw.update(%s)
try:
    m = timm.create_model("vit3_tiny", **kw)
except Exception as e:
    print(f"{type(e).__name__}: {e}")
    sys.exit(0)
blocks = len(getattr(m, "blocks", []))
print(f"built: {blocks} blocks, head {type(m.head).__name__}, num_classes {getattr(m, 'num_classes', None)}")
'''


def c_create(arg, value):
    def f(c):
        r = c.py(CREATE % f"{{{arg!r}: {value!r}}}")
        said = r["out"].strip().splitlines()[-1] if r["out"].strip() else ""
        ok = r["rc"] == 0 and said.startswith("ValueError") and arg in said
        rr = dict(r, err=r["err"] or said, rc=r["rc"])
        return dict(r=rr, ok=ok, note=f"create_model: {said[:200]}", line=said)
    return f


def c_symlink_loop(c):
    data = c.p("loop_data")
    shutil.rmtree(data, ignore_errors=True)
    shutil.copytree(c.p("digits"), data)
    os.symlink("..", os.path.join(data, "train", "zero", "loop"))
    shutil.rmtree(c.p("runs", "loop"), ignore_errors=True)
    r = c.run(*c.train("--epochs", "1", data=data, name="loop"), timeout=180)
    return dict(r=r, ok=_oneline(r))


def _modes(folder, pattern):
    return {os.path.basename(p): oct(stat.S_IMODE(os.stat(p).st_mode)) for p in sorted(glob.glob(os.path.join(
        folder, pattern)))}


def c_mode_run(c):
    modes = _modes(c.p("runs", "r"), "*.safetensors")
    ok = bool(modes) and all(m == "0o644" for m in modes.values())
    return dict(r=dict(rc=0, out="", err=""), ok=ok, note="RUN (trained under umask 022): " +
                ", ".join(f"{k} {v}" for k, v in modes.items()), line=str(modes))


def c_mode_hub(c):
    modes = _modes(c.p("hub_good"), "*")
    ok = bool(modes) and all(m == "0o644" for m in modes.values())
    return dict(r=dict(rc=0, out="", err=""), ok=ok, note="Hub folder (convert under umask 022): " +
                ", ".join(f"{k} {v}" for k, v in modes.items()), line=str(modes))


KILL_AT_RENAME = r'''
import os, re, signal, sys
def wrap(fn):
    def f(src, dst, *a, **k):
        if re.match(r"\.tmp-", os.path.basename(os.fsdecode(src))) and os.fsdecode(dst).endswith(".onnx"):
            os.kill(os.getpid(), signal.SIGKILL)
        return fn(src, dst, *a, **k)
    return f
os.replace, os.rename = wrap(os.replace), wrap(os.rename)
from ttt_zoo.cli import main
sys.exit(main(sys.argv[1:]))
'''


def c_killed_export(c):
    folder = c.p("export_kill")
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    out = os.path.join(folder, "m.onnx")
    argv = ["export", "--model", "vit3_tiny", "--model-kwargs", *KW, "img_size=16", "num_classes=10", "--out", out]
    k = c.run(*argv, code=KILL_AT_RENAME)
    left = _stale(folder)
    if k["rc"] != -signal.SIGKILL:
        raise SetupFailed(f"the export was not killed at its rename (exit {k['rc']}: {line_of(k['err'], k['rc'])})")
    r = c.run(*argv)
    after = _stale(folder)
    note = f"left by the killed export: {left or 'none'}; after the next export: {after or 'none'}"
    return dict(r=r, ok=_ok0(r) and not after, note=note)


def c_hub(edit, mem=False):
    def f(c):
        c.n += 1
        hub = _hub_with(c, f"hub_edit_{c.n}", edit)
        r = c.run("predict", c.p("imgs", "seven.png"), "--checkpoint", hub, "-j", "0", mem=mem)
        return dict(r=r, ok=_oneline(r))
    return f


def c_img_size_oom(c):
    shutil.rmtree(c.p("runs", "oom"), ignore_errors=True)
    r = c.run(*c.train("--epochs", "1", "--img-size", "8192", name="oom"), mem=True, timeout=240)
    line = line_of(r["err"], r["rc"])
    sizes = [int(x) for x in re.findall(r"\b(\d{2,5})\b", line) if int(x) != 8192]
    return dict(r=r, ok=_oneline(r) and bool(sizes), note="(RLIMIT_AS 10 GiB)" + (
        f"; sizes named: {sizes[:4]}" if sizes else "; no other size named"))


CTRL_C = r'''
import os, signal, sys, torch
_orig, fired = torch.nn.Module.__call__, []
def call(self, *a, **k):
    if not fired:
        fired.append(1)
        os.kill(os.getpid(), signal.SIGINT)
    return _orig(self, *a, **k)
torch.nn.Module.__call__ = call
from ttt_zoo.cli import main
sys.exit(main(sys.argv[1:]))
'''


def c_ctrl_c(cmd):
    def f(c):
        if cmd == "validate":
            argv = ["validate", "--checkpoint", c.p("runs", "r"), "-j", "0"]
        elif cmd == "predict":
            argv = ["predict", c.p("digits", "val"), "--checkpoint", c.p("runs", "r"), "-j", "0"]
        else:
            argv = ["export", "--model", "vit3_tiny", "--model-kwargs", *KW, "img_size=16", "num_classes=10",
                    "--out", c.p("ctrlc.onnx"), "--force"]
        r = c.run(*argv, code=CTRL_C)
        nlines = len([ln for ln in r["err"].splitlines() if ln.strip()])
        return dict(r=r, ok=r["rc"] == 130 and "Traceback" not in r["err"] and nlines <= 1,
                    note=f"{nlines} stderr line(s)")
    return f


def c_export_num_classes(c):
    out = c.p("nc.onnx")
    r = c.run("export", "--model", "vit3_tiny", "--model-kwargs", *KW, "img_size=16", "--checkpoint",
              c.p("good.safetensors"), "--num-classes", "10", "--out", out, "--force")
    return dict(r=r, ok=_ok0(r) and os.path.isfile(out))


def c_resume_num_classes(c):
    run = _copy(c, os.path.join("runs", "r4"), "res_nc")
    before = _tree_hash(run)
    r = c.run("train", "--resume", run, "--num-classes", "5")
    cmp = _compare(before, _tree_hash(run))
    line = line_of(r["err"], r["rc"])
    return dict(r=r, ok=_oneline(r) and "None" not in line and cmp == "identical", bytes=cmp)


def c_transposed(c):
    r = c.run("predict", c.p("imgs", "seven.png"), *c.model_args(c.p("transposed.safetensors")))
    line = line_of(r["err"], r["rc"])
    contradicts = bool(re.search(r"16 classes|num_classes=16", line))  # the head has 10 rows' worth: 10 classes
    ok = _oneline(r) and not contradicts and ("transpos" in line.lower() or ("(16, 10)" in line and "(10, 16)" in
                                                                             line))
    return dict(r=r, ok=ok, note="says 16 classes / num_classes=16 for a 10-class head" if contradicts else "")


def c_nan_init(c):
    shutil.rmtree(c.p("runs", "nan_init"), ignore_errors=True)
    r = c.run(*c.train("--epochs", "1", "--initial-checkpoint", c.p("nan_all.safetensors"), name="nan_init"))
    line = line_of(r["err"], r["rc"])
    blames_lr = bool(re.search(r"learning rate|--lr\b", line))
    names = "nan_all.safetensors" in line or "initial-checkpoint" in line
    return dict(r=r, ok=_oneline(r) and not blames_lr and names,
                note=("blames the learning rate" if blames_lr else "") + ("" if names else " (the file not named)"))


def c_non_utf8(cmd):
    def f(c):
        if cmd == "predict":
            out = c.p("bad_names.csv")
            if os.path.exists(out):
                os.remove(out)
            r = c.run("predict", c.p("imgs_bad"), "--checkpoint", c.p("runs", "r"), "-j", "0", "--results-file", out)
        else:
            data = c.p("bad_names")
            if not os.path.isdir(data):
                shutil.copytree(c.p("digits"), data)
                shutil.copy(os.path.join(os.fsencode(c.p("imgs_bad")), b"bad\xff.png"),
                            os.path.join(os.fsencode(data), b"train", b"zero", b"bad\xff.png"))
            shutil.rmtree(c.p("runs", "bad_names"), ignore_errors=True)
            r = c.run(*c.train("--epochs", "1", data=data, name="bad_names"))
        line = line_of(r["err"], r["rc"])
        unclear = bool(re.search(r"surrogate|codec|UnicodeEncodeError|UnicodeDecodeError", r["err"]))
        ok = not unclear and "Traceback" not in r["err"] and (r["rc"] == 0 or _oneline(r))
        return dict(r=r, ok=ok, note=("" if not unclear else "an encoding error") + (
            f"; name shown as: {re.findall(r'bad[^ ,:]*png', r['out'] + r['err'])[:1]}" if r["rc"] == 0 else ""),
            line=line)
    return f


CHANNELS = r'''
import torch, timm, ttt_zoo
torch.manual_seed(0)
m = timm.create_model("vit3_tiny", img_size=16, patch_size=4, embed_dim=16, num_heads=2, depth=1, num_classes=10).eval()
x = torch.randn(2, 3, 16, 16)
with torch.no_grad():
    ref = m(x)
    if %r == "memory_format":
        y = m(x.contiguous(memory_format=torch.channels_last))
        print(f"channels_last memory format: max |diff| {(y - ref).abs().max().item():.2e}")
    else:
        try:
            m(x.permute(0, 2, 3, 1))
            print("NHWC tensor: accepted")
        except Exception as e:
            print(f"{type(e).__name__}: {e}".splitlines()[0])
'''


def c_channels(kind):
    def f(c):
        r = c.py(CHANNELS % kind)
        said = r["out"].strip().splitlines()[-1] if r["out"].strip() else ""
        if kind == "memory_format":
            m = re.search(r"diff\| ([\d.e+-]+)", said)
            ok = r["rc"] == 0 and m is not None and float(m.group(1)) < 1e-4
        else:
            ok = r["rc"] == 0 and bool(re.search(r"channels.last|NHWC|permute|\(B, C, H, W\)|channels-first",
                                                 said, re.I))
        return dict(r=dict(r, err=r["err"] or said), ok=ok, note=said[:200], line=said)
    return f


def c_extra_out(kind):
    """Deliver 1: the other output flags pointed into a copy of RUN (or at it), with --force."""
    def argv_of(c, run):
        if kind == "validate":
            return ["validate", "--checkpoint", run, "-j", "0", "--results-file", os.path.join(run, "summary.csv"),
                    "--force"]
        if kind == "predict-dir":
            return ["predict", c.p("imgs", "seven.png"), "--checkpoint", run, "--results-dir", run, "--force",
                    "-j", "0"]
        if kind == "attention-map":
            return ["attention-map", "--model", "vit3_tiny", "--checkpoint", run, "--query-pixel", "4", "4",
                    "--img-size", "16", "--out", os.path.join(run, "train_plot.png"), "--force"]
        if kind == "convert":
            return ["convert", c.p("good.safetensors"), "--model", "vit3_tiny.x", "--model-kwargs", *KW,
                    "img_size=16", "num_classes=10", "--out", run, "--force", "--no-flops"]
        if kind == "export-new":
            return ["export", "--model", "vit3_tiny", "--model-kwargs", *KW, "img_size=16", "num_classes=10",
                    "--out", os.path.join(run, "model.onnx"), "--force"]
        raise AssertionError(kind)
    return _at_risk(os.path.join("runs", "r"), argv_of)


def _hub_edit(**pc):
    def edit(cfg):
        cfg.setdefault("pretrained_cfg", {}).update(pc)
    return edit


def _hub_model_args(**ma):
    def edit(cfg):
        cfg.setdefault("model_args", {}).update(ma)
    return edit


IMG = lambda c: c.p("imgs", "seven.png")  # noqa: E731

CASES = [
    # (section, case, rule, scenario)
    ("data lost", "predict IMG --checkpoint RUN --results-file RUN/summary.csv --force",
     "one-line refusal, RUN identical",
     _at_risk(os.path.join("runs", "r"), lambda c, run: [
         "predict", IMG(c), "--checkpoint", run, "--results-file", os.path.join(run, "summary.csv"), "--force",
         "-j", "0"])),
    ("data lost", "export --checkpoint RUN --out RUN/best.safetensors --force (--model vit3_tiny --model-kwargs "
                  "num_classes=10, which 299558e needs)",
     "one-line refusal, RUN identical",
     _at_risk(os.path.join("runs", "r"), lambda c, run: [
         "export", "--model", "vit3_tiny", "--model-kwargs", "num_classes=10", "--checkpoint", run, "--out",
         os.path.join(run, "best.safetensors"), "--force"])),
    ("data lost", "convert W --out RUN --force while a train holds RUN's lock (trainer paused by SIGSTOP)",
     "one-line refusal, RUN identical, the folder and its lock file the same inodes", c_convert_live),
    ("data lost (Deliver 1)", "validate --checkpoint RUN --results-file RUN/summary.csv --force",
     "one-line refusal, RUN identical", c_extra_out("validate")),
    ("data lost (Deliver 1)", "predict IMG --checkpoint RUN --results-dir RUN --force",
     "one-line refusal, RUN identical", c_extra_out("predict-dir")),
    ("data lost (Deliver 1)", "attention-map --checkpoint RUN --out RUN/train_plot.png --force",
     "one-line refusal, RUN identical", c_extra_out("attention-map")),
    ("data lost (Deliver 1)", "convert W --out RUN --force (no train running)",
     "one-line refusal, RUN identical", c_extra_out("convert")),
    ("data lost (Deliver 1)", "export --out RUN/model.onnx --force (a new file inside RUN)",
     "one-line refusal, RUN identical", c_extra_out("export-new")),

    ("run others cannot read", "train --linearize-from deit_tiny_patch16_224 --initial-checkpoint W (T5 run)",
     "exit 0 and the run records a t5_* model (args.yaml or run.json)", c_t5_train),
    ("run others cannot read", "validate --checkpoint T5RUN (no --model)", "exit 0", c_t5_cmd("validate")),
    ("run others cannot read", "predict IMG --checkpoint T5RUN (no --model)", "exit 0", c_t5_cmd("predict")),
    ("run others cannot read", "export --checkpoint T5RUN --out t5.onnx (no --model)", "exit 0 and the file",
     c_t5_cmd("export")),
    ("run others cannot read", "attention-map --checkpoint T5RUN --query-pixel 4 4 (no --model)",
     "exit 0 and the PNG", c_t5_cmd("attention-map")),
    ("run others cannot read", "convert T5RUN --tag lin, then push HUB --source T5RUN --dry-run (no --model)",
     "both exit 0", c_t5_cmd("push")),
    ("run others cannot read", "export --checkpoint RUN --out x.onnx (no --model)",
     "exit 0, an ONNX output of 10 classes", c_export_run(False)),
    ("run others cannot read", "export --checkpoint RUN --model vit3_tiny (the run's num_classes 10)",
     "exit 0, an ONNX output of 10 classes", c_export_run(True)),
    ("run others cannot read", "attention-map --checkpoint RUN (no --model)",
     "exit 0 and the map taken at the run's 16 px (a 4 x 4 token grid)", c_attn_run(False)),
    ("run others cannot read", "attention-map --checkpoint RUN --model vit3_tiny (the run's image size 16)",
     "exit 0 and the map taken at the run's 16 px (a 4 x 4 token grid)", c_attn_run(True)),
    ("run others cannot read", "push HUB --source RUN --dry-run (HUB converted from RUN)", "exit 0", c_push_run),

    ("resume", "train --epochs 2, then --resume RUN --epochs 4: the lr column",
     "exit 0, the 3rd and 4th epochs in summary.csv with lr > 0 (the schedule extended)", c_resume_epochs),
    ("resume", "--resume RUN4 --lr 0.5 (RUN4: lr 0.05, stopped after 1 of 4 epochs)",
     "one-line refusal, or exit 0 with the 2nd epoch's lr above 0.05 (0.5 applied)", c_resume_lr),
    ("resume", "--resume RUN4 --data-dir OTHER (10 classes, other names)", "one-line refusal, RUN4 identical",
     c_resume_data("other")),
    ("resume", "--resume RUN4 --data-dir DIGITS_MOVED (the same classes elsewhere)",
     "exit 0 and the output names the new folder", c_resume_data("same")),
    ("resume", "--resume REL from another folder (REL trained with --data-dir digits, relative; no digits/ there)",
     "exit 0 (the recorded real path is read)", c_resume_relative(False)),
    ("resume", "--resume REL from another folder whose digits/ holds other classes (10, other names)",
     "exit 0 and no file of that folder read (audit hook)", c_resume_relative(True)),

    ("silent wrong answers", "validate --checkpoint RUN on a val folder lacking one class (three)",
     "exit 0 and top-1 = RUN's per-image predictions scored by class name", c_validate_subset("missing")),
    ("silent wrong answers", "validate --checkpoint RUN on a val folder with one class folder empty",
     "as above, or a one-line refusal naming the empty folder", c_validate_subset("empty")),
    ("silent wrong answers", "train with an empty class folder in train/",
     "one-line refusal, nothing committed", c_train_bad_class("empty")),
    ("silent wrong answers", "train with a stray non-class folder in train/ (aa_stray/notes.txt)",
     "one-line refusal, nothing committed", c_train_bad_class("stray")),
    ("silent wrong answers", "predict --checkpoint RUN after RUN's data folder renamed its classes (upper case)",
     "exit 0, every label one of the names RUN recorded", c_predict_renamed),
    ("silent wrong answers", "convert RUN, then predict with the Hub folder: class names",
     "config.json label_names = RUN's names; predict labels by name", c_convert_names),
    ("silent wrong answers", "validate LINK (a link outside RUN to RUN/best.safetensors, one byte flipped)",
     "one-line refusal", c_link_outside),
    ("silent wrong answers", "validate --checkpoint RUN with checkpoint.json deleted (best.safetensors flipped)",
     "one-line refusal naming checkpoint.json", c_no_manifest_validate),
    ("silent wrong answers", "convert RUN with checkpoint.json deleted (best.safetensors flipped)",
     "one-line refusal, no Hub folder", c_no_manifest_convert),
    ("silent wrong answers", "convert weights that are all NaN", "one-line refusal, no Hub folder",
     c_convert_weights("nan_all.safetensors")),
    ("silent wrong answers", "convert weights whose float parameters are stored as int32",
     "one-line refusal, no Hub folder", c_convert_weights("int32.safetensors")),
    ("silent wrong answers", "convert with mean/std 1e-300 (--model-args pretrained_cfg; written into config.json at 299558e)",
     "one-line refusal, no Hub folder", c_convert_std),
    ("silent wrong answers", "create_model('vit3_tiny', depth=-1)", "ValueError naming depth",
     c_create("depth", -1)),
    ("silent wrong answers", "create_model('vit3_tiny', num_classes=-5)", "ValueError naming num_classes",
     c_create("num_classes", -5)),
    ("silent wrong answers", "create_model('vit3_tiny', num_heads=0)", "ValueError naming num_heads",
     c_create("num_heads", 0)),
    ("silent wrong answers", "train on data with a symlink loop (train/zero/loop -> ..)", "one-line refusal",
     c_symlink_loop),
    ("silent wrong answers", "file modes of RUN's *.safetensors (umask 022)", "all 0644", c_mode_run),
    ("silent wrong answers", "file modes of a Hub folder (convert, umask 022)", "all 0644", c_mode_hub),
    ("silent wrong answers", "export killed just before its rename, then export again",
     "exit 0 and no .tmp-* left beside --out", c_killed_export),

    ("tracebacks", "predict with a Hub config std 1e-300", "one-line refusal",
     c_hub(_hub_edit(std=[1e-300] * 3))),
    ("tracebacks", "predict with a Hub config input_size [3, 65536, 65536] (RLIMIT_AS 10 GiB)", "one-line refusal",
     c_hub(_hub_edit(input_size=[3, 65536, 65536]), mem=True)),
    ("tracebacks", "predict with a Hub config crop_pct 1e-9", "one-line refusal",
     c_hub(_hub_edit(crop_pct=1e-9))),
    ("tracebacks", "predict with a Hub config model_args features_only: true", "one-line refusal",
     c_hub(_hub_model_args(features_only=True))),
    ("tracebacks", "predict with a Hub config model_args device: \"meta\"", "one-line refusal",
     c_hub(_hub_model_args(device="meta"))),
    ("tracebacks", "train --img-size 8192 (RLIMIT_AS 10 GiB)", "one-line refusal naming a size that fits",
     c_img_size_oom),
    ("tracebacks", "Ctrl-C in validate", "exit 130, no traceback, at most one line", c_ctrl_c("validate")),
    ("tracebacks", "Ctrl-C in predict", "exit 130, no traceback, at most one line", c_ctrl_c("predict")),
    ("tracebacks", "Ctrl-C in export", "exit 130, no traceback, at most one line", c_ctrl_c("export")),

    ("unclear", "export --num-classes 10 (--checkpoint W)", "exit 0 and the file", c_export_num_classes),
    ("unclear", "--resume RUN4 --num-classes 5", "one-line refusal without 'None', RUN4 identical",
     c_resume_num_classes),
    ("unclear", "predict with weights whose head is transposed", "one-line refusal naming both shapes or "
                                                                 "'transposed', not 16 classes", c_transposed),
    ("unclear", "train --initial-checkpoint W (all NaN)",
     "one-line refusal naming the file, not the learning rate", c_nan_init),
    ("unclear", "predict a folder holding a non-UTF-8 file name --results-file x.csv", "exit 0 or one-line refusal; no encoding error",
     c_non_utf8("predict")),
    ("unclear", "train on data holding a non-UTF-8 file name", "exit 0 or one-line refusal; no encoding error",
     c_non_utf8("train")),
    ("unclear", "model(x) with x in channels_last memory format", "the same output as NCHW-contiguous",
     c_channels("memory_format")),
    ("unclear", "model(x) with x an NHWC tensor (B, H, W, C)", "an error that says channels-last / NHWC",
     c_channels("nhwc")),
]


def run_tree(tree: str, label: str, only=None, keep=False) -> dict:
    work = tempfile.mkdtemp(prefix=f"issue45_{label}_")
    c = Ctx(tree, work)
    t0 = time.time()
    fixtures = make_fixtures(c)
    print(f"[{label}] fixtures in {fixtures['total']} s: {fixtures}", flush=True)
    rows = []
    for i, (section, case, rule, scenario) in enumerate(CASES, 1):
        if only and i not in only:
            continue
        t1 = time.time()
        try:
            res = scenario(c)
            r = res["r"]
            row = dict(rc=r["rc"], line=(res.get("line") or line_of(r["err"], r["rc"] if isinstance(r["rc"], int)
                                                                     else 1))[:300],
                       traceback="Traceback" in r["err"], note=res.get("note", ""), bytes=res.get("bytes"),
                       ok=bool(res["ok"]), facts=res.get("facts"))
        except Exception as e:  # noqa: BLE001 - a scenario that could not be set up is shown, not hidden
            row = dict(rc=None, line="", traceback=False, note=f"setup failed: {type(e).__name__}: {e}"[:400],
                       bytes=None, ok=None, facts=None)
        for k in ("line", "note", "bytes"):  # the scratch folder's path as WORK
            if isinstance(row[k], str):
                row[k] = row[k].replace(os.path.realpath(work), "WORK").replace(work, "WORK")
        row.update(n=i, section=section, case=case, rule=rule, s=round(time.time() - t1, 1))
        row["verdict"] = "setup failed" if row["ok"] is None else "fixed" if row["ok"] else "not fixed"
        rows.append(row)
        print(f"[{label}] {i:2d} {row['verdict']:<12} rc={row['rc']} {row['s']:5.1f}s {case[:70]} | "
              f"{row['line'][:110]} | {row['bytes'] or ''} {row['note'][:160]}", flush=True)
    if keep:
        print(f"[{label}] scratch kept: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return dict(rows=rows, fixtures=fixtures, seconds=round(time.time() - t0, 1))


def _counts(rows):
    fixed = sum(r["verdict"] == "fixed" for r in rows)
    bad = sum(r["verdict"] == "not fixed" for r in rows)
    setup = sum(r["verdict"] == "setup failed" for r in rows)
    tb = sum(r["traceback"] for r in rows)
    return f"{len(rows)} cases: {fixed} fixed, {bad} not fixed, {setup} setup failed; {tb} tracebacks"


def _cell(r):
    esc = lambda s: re.sub(r"/tmp/issue45_[A-Za-z0-9]+_[a-z0-9_]{8}", "WORK",  # noqa: E731
                           str(s).replace("|", "\\|").replace("\n", " "))
    rc = r["rc"] if r["rc"] is not None else "-"
    line = esc(r["line"]) if r["line"] else "(nothing on stderr)" if r["rc"] is not None else ""
    note = f" ({esc(r['note'])})" if r["note"] else ""
    return f"**{rc}** {line}{note}"


def _before_verdict(v):
    return {"not fixed": "reproduces", "fixed": "does not reproduce"}.get(v, v)


def table(before_json: str, after_json: str, out: str) -> None:
    b, a = json.load(open(before_json)), json.load(open(after_json))
    esc = lambda s: str(s).replace("|", "\\|")  # noqa: E731
    nb = sum(r["verdict"] == "not fixed" for r in b["rows"])
    lines = [f"<!-- generated by experiments/issue45_cases.py --table; before: {b['tree']} at {b['commit']}, "
             f"after: {a['tree']} at {a['commit']} -->",
             "# Issue 45: every case, before (299558e) and after", "",
             " ".join(__doc__.split("\n\n")[0].split()).split(" Run on a worktree")[0], "",
             " ".join(__doc__.split("\n\n")[2].split()) if len(__doc__.split("\n\n")) > 2 else "", "",
             "The verdict is a rule per case (the *rule* column), applied by the script to each tree's result: "
             "*fixed* when the rule holds, *not fixed* when it does not; at 299558e a case whose rule does not hold "
             "*reproduces*.  WORK is the scratch folder.", "",
             f"- Before ({b['commit']}): {_counts(b['rows'])}; **{nb} of {len(b['rows'])} reproduce**; "
             f"{b['seconds']:.0f} s in all (fixtures {b['fixtures'].get('total')} s).",
             f"- After ({a['commit']}): {_counts(a['rows'])}; {a['seconds']:.0f} s in all (fixtures "
             f"{a['fixtures'].get('total')} s).", "",
             "| # | section | case | rule | before: exit, first line (note) | after: exit, first line (note) | "
             "bytes compared (before / after) | verdict (before / after) |",
             "|---:|---|---|---|---|---|---|---|"]
    by_n = {r["n"]: r for r in b["rows"]}
    for ra in a["rows"]:
        rb = by_n.get(ra["n"], dict(rc=None, line="", note="not run", bytes=None, verdict="-"))
        by = "" if ra["bytes"] is None and rb.get("bytes") is None else \
            f"{esc(rb.get('bytes') or '-')} / {esc(ra['bytes'] or '-')}"
        lines.append(f"| {ra['n']} | {ra['section']} | {esc(ra['case'])} | {esc(ra['rule'])} | {_cell(rb)} | "
                     f"{_cell(ra)} | {by} | {_before_verdict(rb['verdict'])} / **{ra['verdict']}** |")
    facts = []
    for lab, d in (("before", b), ("after", a)):
        for r in d["rows"]:
            if r.get("facts") and r["facts"].get("lr"):
                facts.append(f"- {lab}, case {r['n']} ({r['case']}): lr by epoch "
                             + ", ".join(f"{e}: {lr:.5g}" for e, lr in r["facts"]["lr"]))
    if facts:
        lines += ["", "## The lr column of summary.csv (resume cases)", ""] + facts
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(out + ".json", "w") as f:
        f.write(json.dumps(dict(before=b, after=a), indent=1, allow_nan=False) + "\n")
    print(f"wrote {out}.md and .json")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", help="checkout to run the cases against")
    ap.add_argument("--label", default="tree")
    ap.add_argument("--json", help="where to write this tree's rows")
    ap.add_argument("--table", nargs=2, metavar=("BEFORE_JSON", "AFTER_JSON"),
                    help="write experiments/results/issue45_cases.{md,json} from two runs")
    ap.add_argument("--out", default=OUT, help="stem of the table files (default %(default)s)")
    ap.add_argument("--only", type=int, nargs="+", help="run these case numbers only, replacing their rows in --json")
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder")
    ap.add_argument("--list", action="store_true", help="list the cases")
    args = ap.parse_args(argv)
    if args.list:
        for i, (section, case, rule, _) in enumerate(CASES, 1):
            print(f"{i:2d} {section}: {case} -- {rule}")
        return 0
    if args.table:
        table(*args.table, args.out)
        return 0
    if not os.path.isfile(os.path.join(args.tree or "", "ttt_zoo", "__init__.py")):
        ap.error(f"--tree {args.tree!r} holds no ttt_zoo/ package (a checkout is needed: its ttt_zoo/ is run)")
    commit = subprocess.run(["git", "-C", args.tree, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", args.tree, "status", "--porcelain", "--untracked-files=no", "--", "ttt_zoo"],
                           capture_output=True, text=True).stdout.strip()
    res = run_tree(args.tree, args.label, args.only, args.keep)
    rows = res["rows"]
    if args.only and args.json and os.path.isfile(args.json):  # the other rows as they were
        old = json.load(open(args.json))
        new = {r["n"]: r for r in rows}
        rows = [new.get(r["n"], r) for r in old["rows"]] + [r for n, r in new.items()
                                                            if n not in {o["n"] for o in old["rows"]}]
        rows.sort(key=lambda r: r["n"])
        res = dict(old, rows=rows)
    data = dict(tree=args.label, commit=commit + (" + uncommitted edits in ttt_zoo/" if dirty else ""), rows=rows,
                fixtures=res["fixtures"], seconds=res["seconds"])
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(data, indent=1, allow_nan=False) + "\n")
    print(_counts(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
