"""Progress bars that also read well in a log file."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from quantkit.cli.base import stderr


class LoggedProgress(Progress):
    """A rich progress bar that, when its console is not a terminal (a log file, CI), prints one plain line per
    step instead (at most one every ``every`` seconds, and always the last): rich draws nothing there until the
    work ends, and a 40-minute AWQ run would look hung. ``shown`` False: nothing at all (a rank other than 0)."""

    def __init__(self, *columns, console: Console, every: float = 5.0, shown: bool = True, **kwargs) -> None:
        super().__init__(*columns, console=console, disable=not (shown and console.is_terminal), **kwargs)
        self.every, self.last_line, self.shown = every, float("-inf"), shown

    def update(self, task_id, **kwargs) -> None:
        super().update(task_id, **kwargs)
        if not self.disable or not self.shown:
            return
        task = next(t for t in self.tasks if t.id == task_id)
        now = time.monotonic()
        if task.finished or now - self.last_line >= self.every:
            self.last_line = now
            elapsed = time.strftime("%H:%M:%S", time.gmtime(task.elapsed or 0.0))
            note = task.fields.get("note", "")
            line = f"{task.description} {task.completed:g}/{task.total:g} {elapsed} {note}".rstrip()
            self.console.print(line, markup=False, highlight=False)


def progress_bar(shown: bool = True) -> Progress:
    """A bar on stderr with a description, a count, the time elapsed and a ``note`` field (``shown`` False: none)."""
    return LoggedProgress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[note]}"),
        console=stderr,
        transient=False,
        shown=shown,
    )
