"""The one base of every error eyas raises on purpose.

An :class:`EyasError` means bad input or a mismatch the user can fix: its message names the file,
the field, the value expected and the value found. The CLI catches this base in one place, prints
the message and exits 2; anything else is a bug and keeps its traceback.
"""


class EyasError(Exception):
    """Bad input or a mismatch the user can fix; the message says what and where."""
