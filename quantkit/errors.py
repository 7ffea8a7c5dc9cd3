"""User-facing errors.

Anything raised as a :class:`QuantkitError` is a problem with the user's input (a missing file, a malformed
recipe, an unsupported model or setting). The CLI prints its message on one line and exits with status 2;
any other exception is a bug in quantkit and keeps its traceback.
"""


class QuantkitError(Exception):
    """Bad input: the message alone tells the user what to fix."""


class GateFailedError(QuantkitError):
    """The quantized model missed its recipe's quality gate; the checkpoint was written beside its destination, as
    ``OUT.rejected``, with the measured figures. The CLI exits with status 3."""

    exit_code = 3


class UnsupportedCheckpointError(QuantkitError):
    """A well-formed checkpoint that the installed readers cannot load (a library's limit, not a damaged file);
    the message names the way round it."""


def one_line(text: object, limit: int = 400) -> str:
    """A library's message (often several lines: a summary, then a numbered list of causes) on one line, cut at
    ``limit`` characters: the first line alone can end in the middle of what it means ("... from one of:")."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."
