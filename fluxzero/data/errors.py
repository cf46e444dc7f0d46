"""The one exception the data package raises for problems a user can fix (pure: no torch)."""
from __future__ import annotations


class DataError(Exception):
    """Bad training data: the message is one sentence that names the file and says what to change."""
