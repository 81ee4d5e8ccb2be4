"""The CLI as a user meets it: help, version, one-line errors with exit codes, no tracebacks."""

import subprocess
import sys

import pytest


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "seq2trt.cli.main", *args], capture_output=True, text=True,
                          timeout=300)


def assert_clean_error(proc: subprocess.CompletedProcess, code: int, *fragments: str) -> None:
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in proc.stderr, proc.stderr


def test_help_and_version():
    listed = run("--help").stdout.split("Commands:")[1]
    names = {line.split()[0] for line in listed.splitlines() if line.strip()}
    # every verb of the design's pipeline (docs/design.md), and translate, has its line
    assert {"export", "fuse", "build", "validate", "bench", "report", "demo", "train", "translate"} <= names, names
    version = run("--version")
    assert version.returncode == 0 and "seq2trt" in version.stdout


@pytest.fixture
def checkpoint(numbers_export):
    """The session's numbers checkpoint: these tests only read it."""
    return numbers_export[0] / "ckpt"


def test_translate_runs_greedy_and_beam(checkpoint):
    greedy = run("translate", str(checkpoint), "123", "45")
    beam = run("translate", str(checkpoint), "123", "--beam-size", "3")
    assert greedy.returncode == 0 and len(greedy.stdout.splitlines()) == 2, greedy.stderr
    assert beam.returncode == 0, beam.stderr


@pytest.mark.parametrize("args, fragments", [
    (["translate", "{ckpt}", "12a"], ["outside the vocabulary", "'a'"]),
    (["translate", "{ckpt}", ""], ["empty source"]),
    (["translate", "{ckpt}", "1" * 40], ["max_src_len"]),
    (["translate", "{ckpt}/missing", "12"], ["not found"]),
    (["train", "-o", "{tmp}/x", "--preset", "huge"], ["unknown preset"]),
    (["train", "-o", "{tmp}/x", "--task", "poetry"], ["unknown task"]),
    (["train", "-o", "{tmp}/x", "--steps", "0"], ["steps must be >= 1"]),
    (["train", "-o", "{ckpt}", "--steps", "1"], ["already exists", "--force"]),
])
def test_bad_input_is_one_line_and_exit_2(checkpoint, tmp_path, args, fragments):
    proc = run(*[a.format(ckpt=checkpoint, tmp=tmp_path) for a in args])
    assert_clean_error(proc, 2, *fragments)
    assert not (tmp_path / "x").exists()


def test_debug_shows_the_traceback(checkpoint):
    proc = run("--debug", "translate", str(checkpoint), "12a")
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode != 0 and "Traceback" in proc.stderr
    assert "InputError" in last and "outside the vocabulary" in last, proc.stderr[-1000:]  # the error itself, raised


def test_train_tiny_writes_checkpoint_and_metrics(tmp_path):
    out = tmp_path / "tiny"
    proc = run("train", "-o", str(out), "--preset", "tiny", "--steps", "3", "--eval-examples", "20")
    assert proc.returncode == 0, proc.stderr
    assert {p.name for p in out.iterdir()} == {"model.safetensors", "config.json", "vocab.json", "metrics.json"}
    assert "heldout_exact_match" in (out / "metrics.json").read_text()
