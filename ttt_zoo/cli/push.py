"""``ttt-zoo push``: validate a converted Hub folder, then ``create_repo`` + ``upload_folder``."""

from ttt_zoo.hub_format import HUB_ORG

from ._common import cli_errors

__all__ = ["add_parser"]


@cli_errors
def run(args) -> int:
    from ttt_zoo.hub import push_folder
    from ttt_zoo.run_folder import resolve_checkpoint
    source = args.source
    if source:  # a run folder or a file in one: the weights convert took from it, checked against the run
        source = resolve_checkpoint(source, "--source").weights
    push_folder(args.folder, args.repo_id, source, args.dry_run, not args.no_source_check, args.private,
                args.revision, args.commit_message, args.token)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("push", help="validate a hub folder and upload it to the Hugging Face Hub",
                       description="Validate a converted folder (card, config, weights load, outputs match the "
                                   "source checkpoint), then create_repo + upload_folder.")
    p.add_argument("folder")
    p.add_argument("--repo-id", help=f"ORG/NAME (default: the id recorded at conversion, {HUB_ORG}/<model>.<tag>)")
    p.add_argument("--source", help="the checkpoint (or `ttt-zoo train` run folder) the folder was converted from (outputs are compared)")
    p.add_argument("--no-source-check", action="store_true", help="skip the comparison with the source")
    p.add_argument("--dry-run", action="store_true", help="validate and print what would be uploaded; no network")
    p.add_argument("--private", action="store_true")
    p.add_argument("--revision", help="branch to upload to (default main)")
    p.add_argument("--commit-message")
    p.add_argument("--token", help="Hugging Face token (default: the logged-in one)")
    p.set_defaults(func=run)
