"""User-facing errors.

Anything raised as a :class:`QuantkitError` is a problem with the user's input (a missing file, a malformed
recipe, an unsupported model or setting). The CLI prints its message on one line and exits with status 2;
any other exception is a bug in quantkit and keeps its traceback.
"""


class QuantkitError(Exception):
    """Bad input: the message alone tells the user what to fix."""
