"""The exception the data package raises for problems a user can fix (pure: no torch)."""

from __future__ import annotations


class DataError(Exception):
    """Bad training data: the message is one sentence that names the file and says what to change."""


class InputFileError(DataError):
    """A file among the inputs is wrong as given (a mask of another size than its image): a usage error, which
    the command line reports with exit status 2 before anything is written."""
