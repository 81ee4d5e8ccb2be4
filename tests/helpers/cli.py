"""The CLI in process (a subprocess costs seconds per call on small CPUs) and how its errors are judged."""

from __future__ import annotations

from click.testing import CliRunner, Result

from seq2trt.cli.main import cli


def invoke(*args) -> Result:
    """`seq2trt ARGS...` through click; arguments may be paths or numbers."""
    return CliRunner().invoke(cli, [str(a) for a in args])


def invoke_ok(*args) -> str:
    """`seq2trt ARGS...`, which must exit 0; returns its output."""
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    return result.output


def one_error_line(result: Result, code: int, *fragments: str) -> str:
    """Exit `code`, no traceback, exactly one error line (ours or click's `Error:`) holding every fragment; returns
    that line. Failure messages show at most 2,000 characters of the output (a huge input may be echoed in it)."""
    output = result.output
    assert result.exit_code == code, output[:2000]
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)[:2000]
    assert "Traceback" not in output, output[:2000]
    lines = [line for line in output.splitlines() if line.lower().startswith("error:")]
    assert len(lines) == 1, output[:2000]
    assert all(f in lines[0] for f in fragments), lines[0][:2000]
    return lines[0]
