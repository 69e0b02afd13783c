"""Errors specrt raises on bad input.

Every message names the problem and the fix. Library code raises these and never exits the
process; the CLI turns them into a one-line message and a non-zero exit status.
"""


class SpecrtError(Exception):
    """Base class: a problem the user can fix (bad file, bad argument, mismatched artifact)."""


class CheckpointError(SpecrtError):
    """The checkpoint directory or file is missing, incomplete or corrupt."""


class UnsupportedArchitectureError(SpecrtError):
    """The checkpoint's architecture or one of its options is not implemented."""


class ManifestMismatchError(SpecrtError):
    """An artifact (ONNX, engine) was made from another checkpoint or with other settings."""


class ArtifactError(SpecrtError):
    """An artifact file is missing, corrupt or not what its manifest says."""


class PromptError(SpecrtError):
    """A prompt is empty or does not fit the context."""


class UsageError(SpecrtError):
    """Options that do not go together, or one that needs another; the CLI shows its usage."""
