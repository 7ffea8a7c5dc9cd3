"""quantkit's version, read from the installed package's metadata (pyproject.toml's ``version`` is the source)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("quantkit")
except PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"
