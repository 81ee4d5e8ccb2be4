"""Progress bars for long steps (the CLI owns the terminal; libraries only call back)."""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from seq2trt.cli.main import err_console


@contextlib.contextmanager
def progress_bar(description: str, total: int) -> Iterator[Callable[..., None]]:
    """Yield `update(completed, **fields)`; the bar shows `fields['status']` when given."""
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[status]}")]
    with Progress(*columns, console=err_console, transient=False) as bar:
        task = bar.add_task(description, total=total, status="")

        def update(completed: int, status: str = "") -> None:
            bar.update(task, completed=completed, status=status)

        yield update


def progress_lines(stage: str) -> Callable[[str], None]:
    """A `progress(message)` callback for a stage's library function that prints each message as one line on
    stderr, with the time since the stage began: a line, not a spinner, so a log file shows a big model's minutes."""
    start = time.monotonic()

    def progress(message: str) -> None:
        minutes, seconds = divmod(int(time.monotonic() - start), 60)
        err_console.print(f"{stage} [{minutes:d}:{seconds:02d}] {message}", highlight=False, markup=False,
                          soft_wrap=True)

    return progress
