"""The command-line interface (a thin wrapper over the Python API)."""
