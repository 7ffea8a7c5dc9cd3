"""quantkit.__version__ is pyproject.toml's version (read from the installed metadata), and ``python -m quantkit``
is the console script."""

import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import quantkit
from quantkit._version import __version__

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def test_the_version_is_pyprojects():
    declared = re.search(r'^\[project\][^\[]*?^version = "([^"]+)"', PYPROJECT.read_text(), re.M | re.S).group(1)
    assert quantkit.__version__ == __version__ == version("quantkit") == declared


def test_python_dash_m_quantkit_runs_the_cli():
    done = subprocess.run([sys.executable, "-m", "quantkit", "--version"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == quantkit.__version__
