"""The package's error types, on the ground floor: every layer may import them, and this module imports nothing
of the package.  Each is a user error that ``ttt-zoo`` prints as one ``error:`` line (exit status 2) and that the
Python API raises as itself."""

__all__ = ["UsageError", "FolderInUseError", "CheckpointError", "HubFolderError", "ExportError", "NoFeaturesError",
           "USER_ERRORS"]


class UsageError(ValueError):
    """A mistake in the command line or in a call: printed as one ``error:`` line, exit status 2."""


class FolderInUseError(UsageError):
    """Another live process holds the folder's lock (one ``error:`` line, exit status 2)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, or does not fit the requested model."""


class HubFolderError(ValueError):
    """A hub folder that is incomplete or inconsistent."""


class ExportError(RuntimeError):
    """The model cannot be exported as asked."""


class NoFeaturesError(RuntimeError):
    """``features_only=True`` for a model without feature maps: a RuntimeError, as timm raises for its models
    without a feature path."""


# printed as their message alone
USER_ERRORS = (UsageError, CheckpointError, HubFolderError, ExportError, NoFeaturesError)
