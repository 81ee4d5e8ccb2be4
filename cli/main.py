"""The `seq2trt` command: thin click verbs over the library.

Errors a user can cause are `Seq2TrtError`s: printed as one line, exit code 2 (bad input) or 1 (a failed
check); a traceback only with `--debug`. Ctrl-C exits 130 and, thanks to atomic writes, leaves no partial file.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import re
import signal
import sys
import threading
from importlib.metadata import PackageNotFoundError, version
from typing import Iterator


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Ctrl-C or SIGTERM while modules load (torch takes seconds) is acted on once they have loaded: raised inside
    an import, it can leave a half-initialised module that then refuses to load again (numpy does), and ends in a
    traceback. Nothing is written at that point, so the command just ends, with one line."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
        yield
        return
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
    if received:
        terminated = signal.SIGTERM in received
        sys.stderr.write(f"{'terminated' if terminated else 'interrupted'}: nothing was written\n")
        sys.exit(143 if terminated else 130)


with _signals_held():
    import click
    from rich.console import Console
    from rich.logging import RichHandler
    from rich.markup import escape

    from seq2trt.core.errors import SIGNALS, Seq2TrtError, Terminated

err_console = Console(stderr=True)


def _version() -> str:
    try:
        return version("seq2trt")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "unknown"


_LONG_VALUE = re.compile(r"\S{201,}")
MAX_LINE = 1000


def clip_values(message: str) -> str:
    """An error echoes what it was given; a value from the user (a 100,000-digit text, a huge file's line) is shown
    by its ends and its length, and a line longer than MAX_LINE characters by its start and its end (where the
    fix usually is)."""
    message = _LONG_VALUE.sub(lambda m: f"{m[0][:60]}…[{len(m[0])} characters]…{m[0][-20:]}", message)
    return "\n".join(line if len(line) <= MAX_LINE else
                     f"{line[:MAX_LINE * 2 // 3]}…[{len(line)} characters]…{line[-MAX_LINE // 3:]}"
                     for line in message.splitlines())


def _stdout_broken(exc: BaseException) -> bool:
    """Whether `exc` is a failed write to standard output (a full disk, a closed pipe): an OSError raised by click.echo
    itself. Standard output is then pointed at /dev/null, so that the interpreter's flush at exit adds no second
    message."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if not (isinstance(exc, OSError) and tb is not None and tb.tb_frame.f_code is click.utils.echo.__code__):
        return False
    with contextlib.suppress(OSError, ValueError, AttributeError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return True


# Verbs whose arguments may start with '-' (texts, file names): what click's "No such option" adds for them.
_DASH_HINTS = {"translate": ("to translate a text that starts with '-'", "the texts", "seq2trt translate SOURCE"),
               "transcribe": ("to transcribe a file whose name starts with '-'", "the files",
                              "seq2trt transcribe MODEL")}


class Seq2TrtGroup(click.Group):
    """Turns library errors into one clear line and an exit code."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["seq2trt.argv"] = list(args)  # the verb's raw arguments, for the '-' hint below
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context):
        if sys.stdout is None:  # started with standard output closed (`>&-`): echo would write nowhere, exit 0
            err_console.print("[bold red]error:[/] cannot write to standard output: it is closed; send it to a file "
                              "or to a program that reads it", highlight=False, soft_wrap=True)
            sys.exit(2)
        try:
            return super().invoke(ctx)
        except click.NoSuchOption as exc:
            # most likely a text such as -5, or a file named -dash.wav
            if ctx.invoked_subcommand in _DASH_HINTS and not exc.possibilities:
                what, them, usage = _DASH_HINTS[ctx.invoked_subcommand]
                given = next((a for a in ctx.meta.get("seq2trt.argv", ()) if a.startswith(exc.option_name)),
                             exc.option_name)  # "-dash.wav", which click names "-d"
                exc.message = (f"{exc.message.rstrip('.')}; {what}, put `--` before {them}: {usage} -- {given}")
            raise
        except (KeyboardInterrupt, Exception) as exc:
            # A signal can land inside a library that turns it into an error of its own (torch.onnx.export wraps
            # whatever its lazy imports raise): once one was received, the command ends as that signal, whatever
            # the exception became.
            if isinstance(exc, KeyboardInterrupt) or _received:
                terminated = isinstance(exc, Terminated) or signal.SIGTERM in _received
                err_console.print(f"[bold red]{'terminated' if terminated else 'interrupted'}[/]: nothing was left "
                                  "half-written")
                sys.exit(Terminated.exit_code if terminated else 130)
            debug = bool(ctx.obj and ctx.obj.get("debug"))
            if not debug and _stdout_broken(exc):
                err_console.print(f"[bold red]error:[/] cannot write to standard output: "
                                  f"{(exc.strerror or str(exc)).lower()}; send it to a file with room, or to a "
                                  "program that reads all of it", highlight=False, soft_wrap=True)
                sys.exit(2)
            if not isinstance(exc, Seq2TrtError) or debug:
                raise
            err_console.print(f"[bold red]error:[/] {escape(clip_values(str(exc)))}", highlight=False,
                              soft_wrap=True)
            sys.exit(exc.exit_code)

    # Verbs are imported when first needed, inside `invoke` (torch takes seconds to load: Ctrl-C or SIGTERM then
    # ends in one line, not a traceback).
    def get_command(self, ctx: click.Context, cmd_name: str):
        _register()
        return super().get_command(ctx, cmd_name)

    def list_commands(self, ctx: click.Context):
        _register()
        return super().list_commands(ctx)


@click.group(cls=Seq2TrtGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(_version(), "--version", prog_name="seq2trt")
@click.option("--debug", is_flag=True, help="Show tracebacks and debug logs.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """seq2trt: ship a trained encoder-decoder Transformer as fast, validated TensorRT engines.

    Pipeline: train (demo) -> export -> fuse -> build -> validate -> bench -> report.
    """
    ctx.ensure_object(dict)["debug"] = debug
    # Our own loggers speak at INFO; third-party libraries (onnxscript's optimizer, ...) only when they warn.
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, format="%(message)s",
                        handlers=[RichHandler(console=err_console, show_path=False, show_time=False)])
    logging.getLogger("seq2trt").setLevel(logging.DEBUG if debug else logging.INFO)


# Each module holds a list COMMANDS of click commands; add a module here to add its verbs.
COMMAND_MODULES = ("model_commands", "import_commands", "export_commands", "validate_commands", "fuse_commands",
                   "build_commands", "bench_commands", "report_commands", "demo_commands", "ort_search_commands",
                   "serve_commands", "transcribe_commands")


def _register() -> None:
    if cli.commands:
        return
    with _signals_held():
        for name in COMMAND_MODULES:
            for command in importlib.import_module(f"seq2trt.cli.{name}").COMMANDS:
                cli.add_command(command)


_received = SIGNALS  # signals that reached a running command (a staged write checks them before committing)


def _terminate(signum, frame) -> None:
    _received.append(signum)
    raise Terminated()


def _interrupt(signum, frame) -> None:
    _received.append(signum)
    raise KeyboardInterrupt()


def main() -> None:
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        cli(prog_name="seq2trt")
    except KeyboardInterrupt as exc:  # outside a verb (start-up, --help): nothing was being written
        sys.stderr.write(f"{'terminated' if isinstance(exc, Terminated) else 'interrupted'}: nothing was written\n")
        sys.exit(Terminated.exit_code if isinstance(exc, Terminated) else 130)


if __name__ == "__main__":
    main()
