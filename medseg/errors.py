"""Exceptions that carry a message meant for the user.

Library code raises these with a message that names the file, key or rank at fault and says what to
do. The CLI prints the message without a traceback and exits with status 2; anything else that
escapes is a bug and keeps its traceback.
"""


class MedsegError(Exception):
    """Base class of every error whose message is written for the user."""


class DataError(MedsegError):
    """An input file, folder or dataset is missing, unreadable or inconsistent."""


class ConfigError(MedsegError):
    """A configuration key or value is unknown or out of range."""


class RunError(MedsegError):
    """A run folder, checkpoint or bundle is missing or does not match what was asked."""
