"""The errors a user can fix. The entry point prints them as one line and exits with status 2."""

from __future__ import annotations


class PipelineError(Exception):
    """A problem with the user's input or environment, with the remedy in the message."""


class ConfigError(PipelineError):
    """A config key holds a value that is not allowed.

    Args:
        key: the dotted key, e.g. ``loader.batch_size``.
        value: the offending value as composed.
        expected: what is allowed, phrased to follow "expected".
    """

    def __init__(self, key: str, value: object, expected: str) -> None:
        self.key, self.value, self.expected = key, value, expected
        super().__init__(f"{key}={value!r} is not allowed: expected {expected}")

    @classmethod
    def missing(cls, key: str) -> ConfigError:
        err = cls(key, "???", f"a value: {key} is required")
        err.args = (f"{key} is required: add {key}=... to the command line",)
        return err


class OverrideError(PipelineError):
    """A command-line override Hydra cannot apply (unknown option or key, bad syntax)."""


class DeviceError(PipelineError):
    """The requested device cannot be used; the message says what was found."""


class DatasetError(PipelineError):
    """A dataset cannot be read; the message names the folder and the files expected."""


class Interruption(Exception):
    """A run stopped on request (a signal, ``pipeline.engine.stopping.Stopped``): recorded KILLED, not FAILED."""
