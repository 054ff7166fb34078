"""Every case of issue 36, each a scripted scenario run against a checkout: exit status, the line it printed, whether a
traceback was printed, and a verdict.  Run on a worktree of 45b8f97 (before) and on HEAD (after):

    git worktree add /tmp/E/before 45b8f97
    python experiments/issue36_cases.py --tree /tmp/E/before --label before --json /tmp/E/before.json
    python experiments/issue36_cases.py --tree . --label after --json /tmp/E/after.json
    python experiments/issue36_cases.py --table /tmp/E/before.json /tmp/E/after.json   # -> experiments/results/

Each command runs as ``PYTHONPATH=TREE python -m ttt_zoo ...`` (this interpreter, the checkout's venv), one thread,
offline, in a scratch folder with fixtures made by the same tree: a tiny digits folder, a 3-epoch run whose best epoch
(``--eval-metric loss``, the highest loss) is its first, weights whose head bias is NaN, Hub folders made by the tree's
own ``convert`` and then damaged.  "line" is the first ``error:`` line on stderr, else a traceback's last line, else
the last stderr line of a command that stopped with another status, else the first stderr line.  A full disk is
simulated: ``OSError(ENOSPC)`` from ``torch.save`` / safetensors' ``save_file`` (where the bytes are written).
"""
import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "experiments", "results", "issue36_cases")
PY = sys.executable
KW = ["depth=1", "embed_dim=16", "num_heads=2", "patch_size=4"]
TINY = ["--model", "vit3_tiny", "--model-kwargs", *KW, "--img-size", "16", "--workers", "0", "--opt", "sgd", "--lr",
        "0.05", "--warmup-epochs", "0", "--log-interval", "100", "-b", "16"]


class Ctx:
    def __init__(self, tree: str, work: str):
        self.tree, self.work = os.path.abspath(tree), work
        self.env = dict(os.environ, PYTHONPATH=self.tree, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
                        PYTHONDONTWRITEBYTECODE="1")

    def p(self, *parts):
        return os.path.join(self.work, *parts)

    def run(self, *argv, timeout=600):
        try:
            return self.popen_result(subprocess.run([PY, "-m", "ttt_zoo", *map(str, argv)], cwd=self.work,
                                                    env=self.env, capture_output=True, text=True, timeout=timeout))
        except subprocess.TimeoutExpired as e:  # still working: stopped here, shown as such
            err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            return dict(rc=f"killed after {timeout} s", out="", err=err)

    def py(self, code, timeout=600):
        return self.popen_result(subprocess.run([PY, "-c", code], cwd=self.work, env=self.env, capture_output=True,
                                                text=True, timeout=timeout))

    @staticmethod
    def popen_result(proc):
        return dict(rc=proc.returncode, out=proc.stdout, err=proc.stderr)

    def train(self, *extra):
        return ["train", "--data-dir", self.p("digits"), "--output", self.p("runs"), *TINY, "--epochs", "1", *extra]

    def model_args(self, weights):
        return ["--model", "vit3_tiny", "--checkpoint", weights, "--model-kwargs", *KW, "--img-size", "16",
                "--num-classes", "10", "-j", "0"]


def line_of(err: str, rc=0) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error")]
    if errors:
        return errors[0]
    if "Traceback" in err or rc:  # a traceback's exception, or the last word of a stopped command
        return lines[-1] if lines else ""
    return lines[0] if lines else ""


# ----- fixtures (made by the tree under test) -----

FIXTURES = r'''
import os, sys, json, numpy as np, torch, timm, ttt_zoo
from PIL import Image
from sklearn.datasets import load_digits
from safetensors.torch import save_file
d = load_digits()
for c in range(10):
    idx = np.flatnonzero(d.target == c)
    for split, ids in (("train", idx[:4]), ("val", idx[4:6])):
        os.makedirs(f"digits/{split}/{c}", exist_ok=True)
        for i in ids:
            img = Image.fromarray((d.images[i] * 255 / 16).astype(np.uint8)).resize((16, 16), Image.BICUBIC)
            img.convert("RGB").save(f"digits/{split}/{c}/{i:04d}.png")
torch.manual_seed(0)
m = timm.create_model("vit3_tiny", img_size=16, num_classes=10, depth=1, embed_dim=16, num_heads=2, patch_size=4)
save_file(m.state_dict(), "good.safetensors")
sd = {k: v.clone() for k, v in m.state_dict().items()}
sd["head.bias"][:] = float("nan")
save_file(sd, "nan.safetensors")
# one digit as 8-bit, 16-bit (the same picture), upright and EXIF-rotated JPEG
g = (d.images[7] * 255 / 16).astype(np.uint8)
g = np.asarray(Image.fromarray(g).resize((16, 24), Image.BICUBIC))
os.makedirs("imgs16", exist_ok=True)
Image.fromarray(g).convert("RGB").save("imgs16/eight.png")
Image.fromarray(g.astype(np.uint16) * 257).save("imgs16/sixteen.png")
os.makedirs("exif", exist_ok=True)
up = Image.fromarray(g).convert("RGB")
up.save("exif/upright.jpg", quality=100, subsampling=0)
ex = Image.Exif(); ex[0x0112] = 6
up.transpose(Image.Transpose.ROTATE_90).save("exif/rotated.jpg", quality=100, subsampling=0, exif=ex)
'''


def make_fixtures(c: Ctx) -> None:
    r = c.py(FIXTURES)
    assert r["rc"] == 0, r["err"][-3000:]
    r = c.run(*c.train("--experiment", "r3", "--epochs", "3", "--eval-metric", "loss"))
    assert r["rc"] == 0, r["err"][-3000:]
    r = c.run("convert", c.p("good.safetensors"), "--model", "vit3_tiny.cases", "--model-kwargs", *KW, "img_size=16",
              "num_classes=10", "--out", c.p("hub_good"), "--no-flops")
    assert r["rc"] == 0, r["err"][-3000:]


def _copy(c, src, name):
    dst = c.p(name)
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(c.p(src), dst)
    return dst


def _flip(path, where="data"):
    """Flip one byte in the data section of a safetensors file (after its JSON header)."""
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        f.seek(8 + n + 64)
        b = f.read(1)
        f.seek(8 + n + 64)
        f.write(bytes([b[0] ^ 0x40]))


def _hub_with(c, name, edit):
    dst = _copy(c, "hub_good", name)
    cfg_path = os.path.join(dst, "config.json")
    cfg = json.load(open(cfg_path))
    text = edit(cfg)
    if isinstance(text, bytes):
        open(cfg_path, "wb").write(text)
    else:
        json.dump(cfg, open(cfg_path, "w"))
    return dst


def _tree_hash(folder):
    h = {}
    for r, _, fs in os.walk(folder):
        for f in sorted(fs):
            p = os.path.join(r, f)
            h[os.path.relpath(p, folder)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return h


def _manifest_epoch(folder):
    try:
        return json.load(open(os.path.join(folder, "checkpoint.json"))).get("epoch")
    except (OSError, ValueError):
        return None


# ----- the cases: (section, case, want, scenario) ; scenario(ctx) -> (result, note or "") -----
# want: "refuse" (one error line, exit 2, nothing lost) or "work" (exit 0 and the right result)

def c_resume_best(c):
    run = _copy(c, os.path.join("runs", "r3"), "r3_resume")
    before = _tree_hash(run)
    r = c.run("train", "--resume", os.path.join(run, "best.state.pt"))
    after = _tree_hash(run)
    changed = sorted(n for n in set(before) | set(after) if before.get(n) != after.get(n))
    return r, ("folder byte-identical" if not changed else f"changed: {', '.join(changed)}"), not changed


def _kill_before_first_commit(c, sig, name):
    shutil.rmtree(c.p("runs", name), ignore_errors=True)
    argv = c.train("--experiment", name, "--epochs", "2")
    proc = subprocess.Popen([PY, "-m", "ttt_zoo", *argv], cwd=c.work, env=c.env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    folder = c.p("runs", name)
    t0 = time.time()
    while time.time() - t0 < 120 and not os.path.exists(os.path.join(folder, "args.yaml")):
        time.sleep(0.02)
    committed = _manifest_epoch(folder) is not None
    proc.send_signal(sig)
    proc.wait()
    return argv, folder, committed


def c_kill_same(sig):
    def f(c):
        name = f"killed_{int(sig)}_same"
        argv, folder, committed = _kill_before_first_commit(c, sig, name)
        r = c.run(*argv)
        return r, ("(the kill came after the first commit)" if committed else ""), r["rc"] == 0
    return f


def c_kill_resume(sig):
    def f(c):
        name = f"killed_{int(sig)}_resume"
        argv, folder, committed = _kill_before_first_commit(c, sig, name)
        r = c.run("train", "--resume", folder)
        return r, ("(the kill came after the first commit)" if committed else ""), r["rc"] == 0
    return f


def c_ctrl_c(c):
    name = "ctrlc"
    shutil.rmtree(c.p("runs", name), ignore_errors=True)
    proc = subprocess.Popen([PY, "-m", "ttt_zoo", *c.train("--experiment", name, "--epochs", "200")], cwd=c.work,
                            env=c.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as from a terminal
    folder = c.p("runs", name)
    t0 = time.time()
    while time.time() - t0 < 120 and not os.path.exists(os.path.join(folder, "checkpoint.json")):
        time.sleep(0.05)
    committed = os.path.exists(os.path.join(folder, "checkpoint.json"))
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        return dict(rc="still running 120 s after Ctrl-C, killed", out="", err=err), "", False
    note = "" if committed else "(Ctrl-C came before the first commit)"
    return dict(rc=proc.returncode, out="", err=err), note, proc.returncode == 130 and "Traceback" not in err


def c_flag(*extra):
    return lambda c: (c.run(*c.train("--experiment", "flag_" + "_".join(extra).replace("-", ""), *extra)), "", None)


def c_args(*argv, timeout=600):
    return lambda c: (c.run(*[a(c) if callable(a) else a for a in argv], timeout=timeout), "", None)


def c_nan_validate(c):
    return c.run("validate", "--data-dir", c.p("digits"), "--split", "val", *c.model_args(c.p("nan.safetensors"))), \
        "", None


def c_nan_predict(c):
    out = c.p("nan_pred.json")
    if os.path.exists(out):
        os.remove(out)
    r = c.run("predict", c.p("digits", "val"), *c.model_args(c.p("nan.safetensors")), "--results-file", out)
    note = ""
    if os.path.exists(out):
        try:
            json.loads(open(out).read(), parse_constant=lambda s: (_ for _ in ()).throw(ValueError(s)))
            note = "wrote valid JSON"
        except ValueError as e:
            note = f"wrote invalid JSON ({e})"
    return r, note, None


def c_nan_push(c):
    shutil.rmtree(c.p("hub_nan"), ignore_errors=True)
    r = c.run("convert", c.p("nan.safetensors"), "--model", "vit3_tiny.nan", "--model-kwargs", *KW, "img_size=16",
              "num_classes=10", "--out", c.p("hub_nan"), "--no-flops")
    if r["rc"] != 0:
        return r, "refused at convert", None
    return c.run("push", c.p("hub_nan"), "--dry-run", "--no-source-check"), "", None


def c_hub_predict(name, edit):
    def f(c):
        hub = _hub_with(c, "hub_" + name, edit)
        return c.run("predict", c.p("digits", "val", "3"), "--checkpoint", hub, "-j", "0"), "", None
    return f


def c_bitflip_hub(c):
    hub = _copy(c, "hub_good", "hub_flip")
    _flip(os.path.join(hub, "model.safetensors"))
    return c.run("predict", c.p("digits", "val", "3"), "--checkpoint", hub, "-j", "0"), "", None


def _flipped_run(c):
    run = _copy(c, os.path.join("runs", "r3"), "r3_flip")
    _flip(os.path.join(run, "best.safetensors"))
    return os.path.join(run, "best.safetensors")


def c_bitflip_convert(c):
    shutil.rmtree(c.p("hub_laundered"), ignore_errors=True)
    return c.run("convert", _flipped_run(c), "--model", "vit3_tiny.x", "--model-kwargs", *KW, "img_size=16",
                 "num_classes=10", "--out", c.p("hub_laundered"), "--no-flops"), "", None


def c_bitflip_init(c):
    return c.run(*c.train("--experiment", "init_flip", "--initial-checkpoint", _flipped_run(c))), "", None


def c_bitflip_export(c):
    out = c.p("flip.onnx")
    if os.path.exists(out):
        os.remove(out)
    return c.run("export", "--model", "vit3_tiny", "--model-kwargs", *KW, "img_size=16", "num_classes=10",
                 "--checkpoint", _flipped_run(c), "--out", out, "--img-size", "16", "16"), "", None


def _top(out):
    return {k: (v.get("index", v.get("label")), v.get("prob")) for k, v in json.loads(out).items()}


def c_png16(c):
    r = c.run("predict", c.p("imgs16", "eight.png"), c.p("imgs16", "sixteen.png"),
              *c.model_args(c.p("good.safetensors")), "--topk", "3", "--label-type", "index")
    if r["rc"] != 0:
        return r, "", False
    got = _top(r["out"])
    same = got["eight.png"] == got["sixteen.png"]
    return r, f"8-bit {got['eight.png']} vs 16-bit {got['sixteen.png']}", same


def c_exif(c):
    r = c.run("predict", c.p("exif", "upright.jpg"), c.p("exif", "rotated.jpg"), *c.model_args(c.p("good.safetensors")),
              "--topk", "3", "--label-type", "index")
    if r["rc"] != 0:
        return r, "", False
    got = _top(r["out"])
    a, b = got["upright.jpg"], got["rotated.jpg"]
    close = a[0] == b[0] and max(abs(x - y) for x, y in zip(a[1], b[1])) < 0.02
    return r, f"upright {a} vs EXIF-rotated {b}", close


FULL_DISK = r'''
import errno, sys, torch, safetensors.torch as st
def full(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")
{patch}
from ttt_zoo.cli import main
sys.exit(main(sys.argv[1:]))
'''


def c_full_disk(patch, argv_of):
    def f(c):
        code = FULL_DISK.replace("{patch}", patch)
        argv = argv_of(c)
        proc = subprocess.run([PY, "-c", code, *argv], cwd=c.work, env=c.env, capture_output=True, text=True,
                              timeout=600)
        return dict(rc=proc.returncode, out=proc.stdout, err=proc.stderr), "simulated ENOSPC", None
    return f


def c_convert_link(c):
    target = _copy(c, "hub_good", "hub_target")
    link = c.p("hub_link")
    if os.path.lexists(link):
        os.remove(link)
    os.symlink(target, link)
    r = c.run("convert", c.p("good.safetensors"), "--model", "vit3_tiny.cases", "--model-kwargs", *KW, "img_size=16",
              "num_classes=10", "--out", link, "--force", "--no-flops")
    partial = [n for n in os.listdir(c.work) if ".partial" in n]
    ok = os.path.islink(link) and not partial and r["rc"] == 0
    return r, f"link kept: {os.path.islink(link)}; .partial-* left: {len(partial)}", ok


def _deep(cfg):
    return "[" * 100000 + "]" * 100000


CASES = [
    ("data lost", "train --resume RUN/best.state.pt (best epoch 1 of 3)", "refuse", c_resume_best),
    ("dead ends", "SIGKILL before the first commit, then the same command", "work", c_kill_same(signal.SIGKILL)),
    ("dead ends", "SIGKILL before the first commit, then --resume RUN", "work", c_kill_resume(signal.SIGKILL)),
    ("dead ends", "SIGTERM before the first commit, then the same command", "work", c_kill_same(signal.SIGTERM)),
    ("dead ends", "SIGTERM before the first commit, then --resume RUN", "work", c_kill_resume(signal.SIGTERM)),
    ("silent wrong answers", "train --clip-grad -1", "refuse", c_flag("--clip-grad", "-1")),
    ("silent wrong answers", "train --warmup-lr -1", "refuse", c_flag("--warmup-lr", "-1", "--warmup-epochs", "1")),
    ("silent wrong answers", "train --opt adamw --lr -1", "refuse", c_flag("--opt", "adamw", "--lr", "-1")),
    ("silent wrong answers", "validate: a model whose outputs are NaN", "refuse", c_nan_validate),
    ("silent wrong answers", "predict: a model whose outputs are NaN (--results-file x.json)", "refuse",
     c_nan_predict),
    ("silent wrong answers", "push --dry-run: a folder whose outputs are NaN", "refuse", c_nan_push),
    ("silent wrong answers", "predict: Hub config.json num_classes -3", "refuse",
     c_hub_predict("ncm3", lambda cfg: cfg.update(num_classes=-3))),
    ("silent wrong answers", "predict: a bit flip in a Hub folder's model.safetensors", "refuse", c_bitflip_hub),
    ("silent wrong answers", "convert RUN/best.safetensors with a bit flip", "refuse", c_bitflip_convert),
    ("silent wrong answers", "train --initial-checkpoint RUN/best.safetensors with a bit flip", "refuse",
     c_bitflip_init),
    ("silent wrong answers", "export --checkpoint RUN/best.safetensors with a bit flip", "refuse", c_bitflip_export),
    ("silent wrong answers", "predict: a 16-bit PNG (same top-3 as its 8-bit image?)", "work", c_png16),
    ("silent wrong answers", "predict: an EXIF-rotated JPEG (same top-3 as the upright one?)", "work", c_exif),
    ("tracebacks", "full disk during an epoch commit (torch.save: ENOSPC)", "refuse",
     c_full_disk("torch.save = full", lambda c: c.train("--experiment", "full_disk"))),
    ("tracebacks", "full disk during convert (save_file: ENOSPC)", "refuse",
     c_full_disk("st.save_file = full", lambda c: ["convert", c.p("good.safetensors"), "--model", "vit3_tiny.full",
                                                   "--model-kwargs", *KW, "img_size=16", "num_classes=10", "--out",
                                                   c.p("hub_full"), "--no-flops"])),
    ("tracebacks", "Ctrl-C in train (exit 130, one line?)", "work", c_ctrl_c),
    ("tracebacks", "config.json: the head missing (no num_classes)", "refuse",
     c_hub_predict("nohead", lambda cfg: cfg.pop("num_classes", None))),
    ("tracebacks", "config.json: num_classes 0", "refuse", c_hub_predict("nc0", lambda cfg: cfg.update(num_classes=0))),
    ("tracebacks", "config.json: num_classes \"ten\"", "refuse",
     c_hub_predict("ncten", lambda cfg: cfg.update(num_classes="ten"))),
    ("tracebacks", "config.json: not UTF-8", "refuse",
     c_hub_predict("latin1", lambda cfg: json.dumps(cfg).replace("vit3", "vit3\u00e9").encode("latin-1"))),
    ("tracebacks", "config.json: deeply nested JSON", "refuse", c_hub_predict("deep", lambda cfg: _deep(cfg).encode())),
    ("tracebacks", "config.json: an architecture of another family (hvit3_tiny)", "refuse",
     c_hub_predict("arch", lambda cfg: cfg.update(architecture="hvit3_tiny"))),
    ("tracebacks", "config.json: std 0", "refuse",
     c_hub_predict("std0", lambda cfg: cfg["pretrained_cfg"].update(std=[0.0, 0.0, 0.0]))),
    ("tracebacks", "config.json: an unknown interpolation", "refuse",
     c_hub_predict("interp", lambda cfg: cfg["pretrained_cfg"].update(interpolation="nearest-ish"))),
    ("tracebacks", "train --lr -1", "refuse", c_flag("--lr", "-1")),
    ("tracebacks", "train --weight-decay -5", "refuse", c_flag("--weight-decay", "-5")),
    ("tracebacks", "train --min-lr -1", "refuse", c_flag("--min-lr", "-1")),
    ("tracebacks", "train --smoothing 5", "refuse", c_flag("--smoothing", "5")),
    ("tracebacks", "train --drop 2", "refuse", c_flag("--drop", "2")),
    ("tracebacks", "train --drop-path 3", "refuse", c_flag("--drop-path", "3")),
    ("tracebacks", "train --img-size 100000", "refuse", c_flag("--img-size", "100000")),
    ("tracebacks", "train --model-kwargs depth=100000", "refuse",
     c_args(lambda c: "train", "--data-dir", lambda c: c.p("digits"), "--output", lambda c: c.p("runs"),
            "--experiment", "deep", "--model", "vit3_tiny", "--model-kwargs", "depth=100000", "embed_dim=16",
            "num_heads=2", "patch_size=4", "--img-size", "16", "--epochs", "1", "-j", "0", timeout=120)),
    ("tracebacks", "predict --crop-pct -1", "refuse",
     c_args("predict", lambda c: c.p("digits", "val", "3"), "--checkpoint", lambda c: c.p("runs", "r3"),
            "--crop-pct", "-1", "-j", "0")),
    ("tracebacks", "predict -j -1", "refuse",
     c_args("predict", lambda c: c.p("digits", "val", "3"), "--checkpoint", lambda c: c.p("runs", "r3"), "-j", "-1")),
    ("tracebacks", "validate -b 0", "refuse",
     c_args("validate", "--checkpoint", lambda c: c.p("runs", "r3"), "-b", "0", "-j", "0")),
    ("tracebacks", "validate --img-size 0", "refuse",
     c_args("validate", "--checkpoint", lambda c: c.p("runs", "r3"), "--img-size", "0", "-j", "0")),
    ("tracebacks", "sample --steps -3", "refuse",
     c_args("sample", "--model", "dit3_s_2", "--tiny", "--steps", "-3", "--out", lambda c: c.p("steps.png"))),
    ("tracebacks", "sample --upscale 100000", "refuse",
     c_args("sample", "--model", "dit3_s_2", "--tiny", "--steps", "2", "--upscale", "100000", "--out",
            lambda c: c.p("upscale.png"))),
    ("names", "validate --model vit3_tinny", "refuse",
     c_args("validate", "--model", "vit3_tinny", "--data-dir", lambda c: c.p("digits"), "--split", "val",
            "--pretrained")),
    ("names", "sample --model dit3_s2", "refuse",
     c_args("sample", "--model", "dit3_s2", "--out", lambda c: c.p("dit3_s2.png"))),
    ("paths", "convert RUN_FOLDER", "work",
     c_args("convert", lambda c: c.p("runs", "r3"), "--model", "vit3_tiny.r3", "--out", lambda c: c.p("hub_r3"),
            "--no-flops", "--force")),
    ("paths", "attention-map --checkpoint RUN_FOLDER", "work",
     c_args("attention-map", "--model", "vit3_tiny", "--checkpoint", lambda c: c.p("runs", "r3"), "--query-pixel",
            "4", "4", "--img-size", "16", "--out", lambda c: c.p("map.png"), "--force")),
    ("paths", "convert --force --out LINK (LINK -> a Hub folder)", "work", c_convert_link),
]


def verdict(want, r, ok):
    if isinstance(r["rc"], str):
        return f"no answer ({r['rc']})"
    tb = "Traceback" in r["err"]
    errs = [ln for ln in r["err"].splitlines() if ln.startswith("error")]
    if tb:
        return "traceback"
    if want == "refuse":
        if ok is False:
            return "data changed"
        if r["rc"] == 2 and len(errs) == 1:
            return "refused in one line"
        if r["rc"] == 0:
            return "silent (exit 0)"
        return f"exit {r['rc']}" + (" (no error line)" if not errs else "")
    if r["rc"] == 0 and ok in (True, None):
        return "works"
    if r["rc"] == 0:
        return "silent wrong answer"
    if want == "work" and ok is True:
        return "works"
    return f"dead end (exit {r['rc']})" if errs else f"exit {r['rc']}"


def run_tree(tree: str, label: str, only=None) -> list:
    work = tempfile.mkdtemp(prefix=f"issue36_{label}_")
    c = Ctx(tree, work)
    make_fixtures(c)
    rows = []
    for i, (section, case, want, scenario) in enumerate(CASES, 1):
        if only and i not in only:
            continue
        t0 = time.time()
        try:
            r, note, ok = scenario(c)
        except Exception as e:  # noqa: BLE001 - a scenario that could not run is shown, not hidden
            r, note, ok = dict(rc=None, out="", err=""), f"scenario failed: {type(e).__name__}: {e}", False
        row = dict(n=i, section=section, case=case, want=want, rc=r["rc"], line=line_of(r["err"], r["rc"])[:300],
                   traceback="Traceback" in r["err"], note=note,
                   verdict=verdict(want, r, ok) if r["rc"] is not None else "not run")
        rows.append(row)
        print(f"[{label}] {i:2d} {row['verdict']:<22} rc={row['rc']} {case} | {row['line'][:100]} {note}",
              flush=True)
        del t0
    shutil.rmtree(work, ignore_errors=True)
    return rows


def table(before_json: str, after_json: str, out: str) -> None:
    sys.path.insert(0, ROOT)
    from ttt_zoo.fileio import atomic_write
    b, a = json.load(open(before_json)), json.load(open(after_json))
    esc = lambda s: str(s).replace("|", "\\|")  # noqa: E731
    lines = [f"<!-- generated by experiments/issue36_cases.py --table; before: {b['tree']} at {b['commit']}, "
             f"after: {a['tree']} at {a['commit']} -->",
             "# Issue 36: every case, before (45b8f97) and after", "",
             __doc__.split("\n\n")[0].replace("\n", " "), "",
             f"Before ({b['commit']}): " + _counts(b["rows"]) + ".  ",
             f"After ({a['commit']}): " + _counts(a["rows"]) + ".", "",
             "| # | section | case | before: exit | before: verdict | after: exit | after: verdict | after: line "
             "(before's line below it) |", "|---:|---|---|---:|---|---:|---|---|"]
    for rb, ra in zip(b["rows"], a["rows"]):
        note_a = f" ({ra['note']})" if ra["note"] else ""
        note_b = f" ({rb['note']})" if rb["note"] else ""
        lines.append(f"| {ra['n']} | {ra['section']} | {esc(ra['case'])} | {rb['rc']} | {rb['verdict']} | {ra['rc']} "
                     f"| {ra['verdict']} | after: {esc(ra['line'])}{esc(note_a)}<br>before: {esc(rb['line'])}"
                     f"{esc(note_b)} |")
    atomic_write(out + ".md", "\n".join(lines) + "\n")
    atomic_write(out + ".json", json.dumps(dict(before=b, after=a), indent=1, allow_nan=False) + "\n")
    print(f"wrote {out}.md and .json")


def _counts(rows):
    from collections import Counter
    c = Counter(r["verdict"] for r in rows)
    tb = sum(r["traceback"] for r in rows)
    silent = sum(r["verdict"].startswith("silent") for r in rows)
    return f"{len(rows)} cases; {tb} tracebacks, {silent} silent exits; " + ", ".join(f"{v}: {n}" for v, n in
                                                                                      c.most_common())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", help="checkout to run the cases against")
    ap.add_argument("--label", default="tree")
    ap.add_argument("--json", help="where to write this tree's rows")
    ap.add_argument("--table", nargs=2, metavar=("BEFORE_JSON", "AFTER_JSON"),
                    help="write experiments/results/issue36_cases.{md,json} from two runs")
    ap.add_argument("--out", default=OUT, help="stem of the table files (default %(default)s)")
    ap.add_argument("--only", type=int, nargs="+", help="run these case numbers only, replacing their rows in --json")
    args = ap.parse_args(argv)
    if args.table:
        table(*args.table, args.out)
        return 0
    commit = subprocess.run(["git", "-C", args.tree, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", args.tree, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    rows = run_tree(args.tree, args.label, args.only)
    if args.only and args.json and os.path.isfile(args.json):  # the other rows as they were
        new = {r["n"]: r for r in rows}
        rows = [new.get(r["n"], r) for r in json.load(open(args.json))["rows"]]
    data = dict(tree=args.label, commit=commit + (" + uncommitted edits" if dirty else ""), rows=rows)
    text = json.dumps(data, indent=1, allow_nan=False) + "\n"
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    print(_counts(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
