"""The errors mlx-moestream raises: one base, `MoestreamError`, for a caller to catch.

Each message names what was wrong (file, tensor, layer, expert, number); the CLI prints it as one
line. Errors of bad input are also `ValueError`s, as they were before this base existed.
"""


class MoestreamError(Exception):
    """Anything mlx-moestream refuses or cannot do."""


class ModelError(MoestreamError, ValueError):
    """A model that cannot be found, read by mlx-lm, or streamed."""


class StoreError(MoestreamError, ValueError):
    """A model's files cannot serve its experts."""


class BudgetError(MoestreamError, ValueError):
    """A budget that cannot be parsed or is too small to run the model."""


class ProfileError(MoestreamError, ValueError):
    """A profile that cannot be found, parsed, or applied to this model."""


class TraceError(MoestreamError, ValueError):
    """A routing trace that is missing, unreadable or malformed."""


class ClosedError(MoestreamError, RuntimeError):
    """The model was closed (`moestream.close()`); it must be loaded again to stream."""

    def __init__(self) -> None:
        super().__init__("this model was closed (moestream.close()): load it again to stream "
                         "its experts")


class NotCopyableError(ModelError):
    """A streamed model holds open files, I/O threads and slot pools."""

    def __init__(self) -> None:
        super().__init__("a streamed model cannot be copied or pickled (it holds open files, "
                         "I/O threads and slot pools): load it again instead")
