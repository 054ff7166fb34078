"""The run folder of ``ttt-zoo train``, end to end: its one owner.

A run folder holds::

    args.yaml                   the arguments of the run's first start
    args.resume-epoch<N>.yaml   the arguments of a ``--resume`` at epoch N (they update args.yaml's)
    run.json                    the run record: the model as built, its classes, its data (real path), epochs, lr
    checkpoint.json             the commit manifest: epoch, best epoch, the sha256 of each committed file
    <tag>.state.pt              exact-resume training state (tags ``last``, ``best``)
    <tag>.safetensors           the model's weights; <tag>_ema.safetensors the EMA weights (--model-ema)
    summary.csv                 one row per committed epoch
    log.txt, train_plot.png     what a person reads

- :mod:`.layout`: the names, and whether a path is (in) a run folder; only ``train`` writes there;
- :mod:`.writer`: creating the folder, its lock, the arguments (``ttt-zoo train`` only);
- :mod:`.commit`: committing an epoch's set atomically, finishing a cut-off commit, and the one hash check of every
  committed file a reader is handed;
- :mod:`.record`: what the run recorded, and the one resolver of ``--checkpoint`` / ``--resume`` (every command
  that reads a run builds its model from the record alone).
"""
from .commit import *  # noqa: F401,F403
from .commit import __all__ as _commit_all
from .layout import *  # noqa: F401,F403
from .layout import __all__ as _layout_all
from .record import *  # noqa: F401,F403
from .record import __all__ as _record_all
from .writer import *  # noqa: F401,F403
from .writer import __all__ as _writer_all

__all__ = [*_layout_all, *_commit_all, *_record_all, *_writer_all]
