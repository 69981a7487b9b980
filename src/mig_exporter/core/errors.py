"""Errors a read can end in. Each one's ``str()`` is a single line for the log."""

from __future__ import annotations


class ReadError(Exception):
    """A read produced no snapshot."""


class ParseError(ReadError):
    """The driver's output could not be read (malformed, hostile or not nvidia-smi's)."""


class CommandError(ReadError):
    """A command could not be run to a clean finish."""


class CommandNotFound(CommandError):
    """The binary does not exist or cannot be executed."""


class CommandTimeout(CommandError):
    """The command ran past its deadline; its process group was killed and reaped."""


class CommandFailed(CommandError):
    """The command exited non-zero; the message carries the first line of its stderr."""


class OutputTooLarge(CommandError):
    """The command wrote more than the cap; it was killed rather than buffered."""
