"""Plain file outputs (`translate --output-ids F`, standard output): a device or a FIFO is written in place, never
replaced by a regular file; a symlink is written through, to its target; an output that is one of the command's
inputs, or a folder, is refused before any decode; a full or closed standard output is one error line.

Devices are made here with os.mknod (a null-like and a full-like one in tmp_path): the machine's own /dev/null and
/dev/full are never written to.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

NULL, FULL = os.makedev(1, 3), os.makedev(1, 7)


def make_device(path: Path, device: int) -> Path:
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, device)
    except PermissionError:
        pytest.skip("making a device node needs root")
    return path


def ids_file(work: Path) -> Path:
    path = work / "ids.jsonl"
    path.write_text("[4, 5, 2]\n[6, 2]\n")
    return path


def test_a_regular_file_is_replaced_atomically(work, invoke):
    out = work / "out.jsonl"
    out.write_text("old\n")
    before = os.stat(out).st_ino
    result = invoke("translate", work / "ckpt", "12", "7", "--output-ids", out)
    assert result.exit_code == 0, result.output
    assert len(out.read_text().splitlines()) == 2 and all(isinstance(json.loads(line), list)
                                                          for line in out.read_text().splitlines())
    assert os.stat(out).st_ino != before  # renamed into place, not rewritten
    assert [p.name for p in work.iterdir() if p.name.startswith(".out.jsonl")] == []


def test_a_device_is_written_in_place(work, invoke):
    device = make_device(work / "null", NULL)
    result = invoke("translate", work / "ckpt", "12", "--output-ids", device)
    assert result.exit_code == 0, result.output
    st = os.lstat(device)
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == NULL
    assert sorted(p.name for p in work.iterdir() if p.name.startswith(".null")) == []


def test_a_full_device_is_one_write_error_and_stays_a_device(work, invoke, one_error_line):
    device = make_device(work / "full", FULL)
    one_error_line(invoke("translate", work / "ckpt", "12", "--output-ids", device), 2,
                   f"cannot write {device}", "no space left on the device")
    st = os.lstat(device)
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == FULL


def test_a_fifo_is_written_in_place(work, invoke):
    fifo = work / "fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    result = invoke("translate", work / "ckpt", "12", "7", "--output-ids", fifo)
    reader.join(timeout=60)
    assert result.exit_code == 0, result.output
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert len(got[0].decode().splitlines()) == 2


def test_a_symlink_is_written_through_to_its_target(work, invoke):
    target = work / "real" / "ids-out.jsonl"
    target.parent.mkdir()
    target.write_text("old\n")
    link = work / "link.jsonl"
    link.symlink_to(target)
    result = invoke("translate", work / "ckpt", "12", "--output-ids", link)
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert isinstance(json.loads(target.read_text()), list)
    device_link = work / "device-link"
    device_link.symlink_to(make_device(work / "null", NULL))  # through a link to a device: in place too
    assert invoke("translate", work / "ckpt", "12", "--output-ids", device_link).exit_code == 0
    assert device_link.is_symlink() and stat.S_ISCHR(os.lstat(work / "null").st_mode)


def test_a_folder_as_output_is_one_error_line(work, invoke, one_error_line, snapshot):
    (work / "folder").mkdir()
    before = snapshot(work)
    one_error_line(invoke("translate", work / "ckpt", "12", "--output-ids", work / "folder"), 2,
                   f"--output-ids {work / 'folder'} is a directory", "give a file path")
    assert snapshot(work) == before


@pytest.mark.parametrize("spelling", ["same", "symlink", "dotdot", "hardlink"])
def test_an_output_that_is_the_ids_file_is_refused_before_decoding(work, spelling, invoke, one_error_line, snapshot,
                                                                   monkeypatch):
    from seq2trt.runtime import decode_jobs

    ids = ids_file(work)
    output = {"same": lambda: ids, "dotdot": lambda: work / "ckpt" / ".." / ids.name,
              "symlink": lambda: (work / "alias").symlink_to(ids) or work / "alias",
              "hardlink": lambda: os.link(ids, work / "alias") or work / "alias"}[spelling]()
    monkeypatch.setattr(decode_jobs, "decode_batches", lambda *a: pytest.fail("decoded before refusing"))
    before = snapshot(work)
    one_error_line(invoke("translate", work / "ckpt", "--ids-file", ids, "--output-ids", output), 2,
                   f"--output-ids {output}", "is the --ids-file", "choose another file")
    assert snapshot(work) == before


def test_an_output_onto_the_model_it_reads_is_refused(work, invoke, one_error_line, snapshot):
    before = snapshot(work)
    one_error_line(invoke("translate", work / "ckpt", "12", "--output-ids", work / "ckpt" / "model.safetensors"),
                   2, "model.safetensors", "which this command reads", "choose another file")
    assert snapshot(work) == before


def _translate_into(work: Path, stdout) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "seq2trt.cli.main", "translate", str(work / "ckpt"), "12", "7"],
                          stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=120)


def _one_stderr_line(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    assert all(f in lines[0] for f in fragments), lines[0]


def test_a_full_standard_output_is_one_error_line(work):
    with open(make_device(work / "full", FULL), "w") as full:
        proc = _translate_into(work, full)
    _one_stderr_line(proc, "cannot write to standard output", "no space left")


def test_a_closed_standard_output_is_one_error_line(work):
    read, write = os.pipe()
    os.close(read)  # nobody reads: the first write gets EPIPE
    try:
        proc = _translate_into(work, write)
    finally:
        os.close(write)
    _one_stderr_line(proc, "cannot write to standard output", "broken pipe")


def test_a_standard_output_closed_at_start_is_one_error_line(work):
    """`seq2trt translate ... >&-`: Python starts with sys.stdout None and click's echo then writes nowhere; the
    translations were lost with exit 0."""
    proc = subprocess.run([sys.executable, "-m", "seq2trt.cli.main", "translate", str(work / "ckpt"), "12", "7"],
                          stderr=subprocess.PIPE, text=True, timeout=120, preexec_fn=lambda: os.close(1))
    _one_stderr_line(proc, "cannot write to standard output", "closed")
