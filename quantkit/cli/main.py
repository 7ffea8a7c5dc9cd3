"""``quantkit`` command line: parses arguments and calls the Python API, nothing more.

Bad input (a QuantkitError) prints one line on stderr and exits with status 2; no output is left behind.
"""

from __future__ import annotations

import importlib.util
import logging
import signal

import click
from rich.logging import RichHandler

from quantkit.cli.base import QuantkitGroup, stderr
from quantkit.cli.commands import (
    eval_command,
    export_command,
    import_command,
    inspect_command,
    quantize_command,
    verify_command,
)
from quantkit.cli.serve import bench_serve_command, generate_command, train_draft_command


@click.group(cls=QuantkitGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
@click.version_option(package_name="quantkit")
def cli(verbose: bool) -> None:
    """Post-training quantization for LLMs: quantize, evaluate, inspect, serve."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(message)s",
        handlers=[RichHandler(console=stderr, show_path=False, show_time=False)],
    )
    for noisy in ("transformers", "datasets", "httpx", "urllib3", "filelock", "huggingface_hub", "fsspec"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    from huggingface_hub.utils import logging as hub_logging
    from transformers.utils import logging as hf_logging

    hub_logging.set_verbosity_error()  # its retries of an unreachable hub would print a dozen lines before ours
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if importlib.util.find_spec("datasets") is not None:  # absent on some GPU images; only text loading needs it
        import datasets

        datasets.disable_progress_bars()
        datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its read errors reach the user as our one line


for command in (
    quantize_command,
    eval_command,
    inspect_command,
    export_command,
    import_command,
    verify_command,
    generate_command,
    bench_serve_command,
    train_draft_command,
):
    cli.add_command(command)


def _terminate(signum, frame) -> None:
    """SIGTERM as an exception in the main thread, so that the cleanup of a half-written output runs."""
    raise SystemExit(128 + signum)


def main() -> None:
    signal.signal(signal.SIGTERM, _terminate)
    cli(prog_name="quantkit")
