"""``quantkit`` command line: parses arguments and calls the Python API, nothing more.

Bad input (a QuantkitError) prints one line on stderr and exits with status 2; no output is left behind.
"""

from __future__ import annotations

import importlib.util
import logging
import signal
import sys

import click
from rich.console import Console
from rich.logging import RichHandler

from quantkit.errors import QuantkitError

console = Console(stderr=True)
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())  # click >= 8.2; 8.1 prints the help itself


class QuantkitGroup(click.Group):
    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """Click's own handling, except that a usage error (an unknown option, a missing or malformed value) is one
        line like every other bad input, instead of click's usage block, hint and message on four lines."""
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except _NO_ARGS_IS_HELP as exc:  # bare `quantkit`: the help, as click shows it
            exc.show()
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx is not None else (prog_name or "quantkit")
            click.echo(f"quantkit: error: {exc.format_message()} (see '{where} --help')", err=True)
            sys.exit(exc.exit_code)
        except click.ClickException as exc:  # a file option that cannot be opened, say
            click.echo(f"quantkit: error: {exc.format_message()}", err=True)
            sys.exit(exc.exit_code)
        except (click.Abort, KeyboardInterrupt, EOFError):
            click.echo("\nquantkit: aborted", err=True)
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except QuantkitError as exc:
            click.echo(f"quantkit: error: {exc}", err=True)
            sys.exit(2)


class QuantkitCommand(click.Command):
    def parse_args(self, ctx, args):
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:  # click's parser leaves some without a context: name this command's help
            if exc.ctx is None:
                exc.ctx = ctx
            raise


@click.group(cls=QuantkitGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
@click.version_option(package_name="quantkit")
def cli(verbose: bool) -> None:
    """Post-training quantization for LLMs: quantize, evaluate, inspect, serve."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(message)s",
        handlers=[RichHandler(console=console, show_path=False, show_time=False)],
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


def _register_commands() -> None:
    from quantkit.cli.commands import eval_command, export_command, import_command, inspect_command, quantize_command
    from quantkit.cli.serve import bench_serve_command, generate_command

    cli.add_command(quantize_command)
    cli.add_command(eval_command)
    cli.add_command(inspect_command)
    cli.add_command(export_command)
    cli.add_command(import_command)
    cli.add_command(generate_command)
    cli.add_command(bench_serve_command)


def _terminate(signum, frame) -> None:
    """SIGTERM as an exception in the main thread, so that the cleanup of a half-written output runs."""
    raise SystemExit(128 + signum)


def main() -> None:
    signal.signal(signal.SIGTERM, _terminate)
    _register_commands()
    cli(prog_name="quantkit")
