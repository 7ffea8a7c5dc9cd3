"""What every ``quantkit`` command shares: the group and command classes that turn bad input into one line and
exit status 2, the consoles, and the ``--device`` / ``--dtype`` readers."""

from __future__ import annotations

import sys

import click
import torch
from rich.console import Console

from quantkit.devices import resolve_device
from quantkit.errors import QuantkitError

stderr = Console(stderr=True)  # logging, progress and status lines
stdout = Console()  # tables and results

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
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
            sys.exit(getattr(exc, "exit_code", 2))  # 3: a quality gate failed (GateFailedError)


class QuantkitCommand(click.Command):
    def parse_args(self, ctx, args):
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:  # click's parser leaves some without a context: name this command's help
            if exc.ctx is None:
                exc.ctx = ctx
            raise


def device_name(name: str | None) -> str:
    """``--device`` as a torch device string (default: cuda when available); a bad one is a QuantkitError."""
    return str(resolve_device(name))


def torch_dtype(name: str, device: str) -> torch.dtype:
    """``--dtype``: one of :data:`DTYPES`, or ``auto`` (float32 on the CPU, bfloat16 elsewhere)."""
    if name == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    return DTYPES[name]
