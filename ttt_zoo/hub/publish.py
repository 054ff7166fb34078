"""Publishing Hub folders: validated, then uploaded with huggingface_hub (``create_repo`` + ``upload_folder``), or
placed in a Hugging Face cache for offline ``hf-hub:`` loading."""
from __future__ import annotations

import os
import shutil
from typing import Any, Callable, Dict, Optional

from ttt_zoo import hub_format as fmt
from ttt_zoo.checkpoint import HUB_ORG
from ttt_zoo.errors import HubFolderError
from ttt_zoo.fileio import atomic_path, atomic_write, sha256_file

from .load import read_config, validate_folder

__all__ = ["install_to_hub_cache", "push_folder"]
def install_to_hub_cache(folder: str, repo_id: str, cache_dir: Optional[str] = None,
                         revision: str = "0" * 40) -> str:
    """Place a folder in a Hugging Face cache as ``repo_id`` (models--ORG--NAME/{blobs,snapshots/<rev>,refs/main}),
    so ``hf-hub:`` loading finds it offline.  Returns the snapshot folder."""
    if cache_dir is None:
        from huggingface_hub import constants
        cache_dir = constants.HF_HUB_CACHE
    repo_dir = os.path.join(cache_dir, "models--" + repo_id.replace("/", "--"))
    snap = os.path.join(repo_dir, "snapshots", revision)
    os.makedirs(snap, exist_ok=True)
    os.makedirs(os.path.join(repo_dir, "blobs"), exist_ok=True)
    os.makedirs(os.path.join(repo_dir, "refs"), exist_ok=True)
    for name in os.listdir(folder):
        src = os.path.join(folder, name)
        if not os.path.isfile(src):
            continue
        blob = os.path.join(repo_dir, "blobs", sha256_file(src))
        with atomic_path(blob, temp=blob + ".incomplete") as tmp:  # huggingface_hub's own partial-file suffix
            shutil.copyfile(src, tmp)
        dst = os.path.join(snap, name)
        if os.path.lexists(dst):
            os.remove(dst)
        os.symlink(os.path.relpath(blob, snap), dst)
    atomic_write(os.path.join(repo_dir, "refs", "main"), revision)
    return snap


def push_folder(folder: str, repo_id: Optional[str] = None, source: Optional[str] = None, dry_run: bool = False,
                check_source: bool = True, private: bool = False, revision: Optional[str] = None,
                commit_message: Optional[str] = None, token: Optional[str] = None,
                log: Callable[[str], None] = print) -> Dict[str, Any]:
    """Validate ``folder`` and upload it with huggingface_hub's ``create_repo`` + ``upload_folder``."""
    report = validate_folder(folder, source=source, check_source=check_source)
    cfg = read_config(folder)
    repo_id = repo_id or fmt.hub_id(cfg)
    if not repo_id or repo_id.count("/") != 1:
        raise HubFolderError(f"Give --repo-id ORG/NAME (got {repo_id!r}); ttt-zoo's scheme is {HUB_ORG}/<model>.<tag>.")
    log(f"validated {folder}: {report['tensors']} tensors, card ok, loads with timm"
        + (f", outputs match {source} (max abs diff {report['max_abs_diff']:.3g})" if report["source_checked"]
           else ", source comparison skipped"))
    if dry_run:
        log(f"dry run: would create {'private ' if private else ''}model repo {repo_id} and upload to "
            f"{revision or 'main'}:")
        for f in report["files"]:
            p = os.path.join(folder, f)
            log(f"  {f}  {os.path.getsize(p):,} bytes  sha256 {sha256_file(p)}")
        report.update(repo_id=repo_id, uploaded=False)
        return report
    from huggingface_hub import HfApi
    api = HfApi(token=token)
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    commit = api.upload_folder(repo_id=repo_id, folder_path=folder, repo_type="model", revision=revision,
                               commit_message=commit_message or f"Upload {repo_id} (ttt-zoo convert)")
    log(f"uploaded {folder} to https://huggingface.co/{repo_id}")
    report.update(repo_id=repo_id, uploaded=True, commit=str(commit))
    return report

