"""Writes that stop midway: a full disk, Ctrl-C (in process and in a real process) and two builds of the same
output at once. Each ends in one clear line and an exit code (2 for the disk, 130 for Ctrl-C), and the previous
artifact stays exactly as it was: nothing half-written, no staging folder, lock or `.old` left. Bad inputs are in
test_bad_inputs.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from helpers.faults import DISK_FULL, fail_on_call, raising


# --- disk full and interrupted writes: the old artifact stays intact ---------------------------------------------

@pytest.mark.parametrize("exc, code, fragments", [
    (DISK_FULL, 2, ("no space left on the device", "free some space")),
    (KeyboardInterrupt(), 130, ("interrupted",)),
], ids=["disk-full", "interrupted"])
def test_failed_fuse_keeps_the_old_fused_graphs(work, monkeypatch, exc, code, fragments, snapshot, invoke):
    """The second graph's save fails inside the staged directory: the previous fused/trt stays as it was. Graphs
    are written through graph_files.save_graph (atomic_write_bytes), so the fault is its fsync: call 1 is the
    encoder's, call 2 the decoder's, after its bytes went to the temporary file."""
    monkeypatch.setattr(os, "fsync", fail_on_call(2, exc, os.fsync))
    before = snapshot(work)
    result = invoke("fuse", work / "out", "--force")
    assert result.exit_code == code and "Traceback" not in result.output, result.output
    assert all(f in result.output for f in fragments), result.output
    assert snapshot(work) == before


@pytest.mark.parametrize("exc, code, fragments", [
    (DISK_FULL, 2, ("cannot write", "report.md: no space left", "the previous report.md is intact")),
    (KeyboardInterrupt(), 130, ("interrupted",)),
], ids=["disk-full", "interrupted"])
def test_failed_report_write_keeps_the_old_report(work, monkeypatch, exc, code, fragments, snapshot, invoke):
    """fsync fails after the bytes went to the temporary file: the old report.md stays, no temporary is left."""
    monkeypatch.setattr(os, "fsync", fail_on_call(1, exc, os.fsync))
    before = snapshot(work)
    result = invoke("report", work / "out")
    assert result.exit_code == code and "Traceback" not in result.output, result.output
    assert all(f in result.output for f in fragments), result.output
    assert snapshot(work) == before


@pytest.mark.rtx
def test_disk_full_mid_build_keeps_the_old_engines(work, monkeypatch, snapshot, invoke, one_error_line):
    """The disk fills while the first plan is written: the old engine directory stays, nothing staged is left."""
    monkeypatch.setattr(os, "fsync", fail_on_call(1, DISK_FULL, os.fsync))
    before = snapshot(work)
    line = one_error_line(invoke("build", work / "out", "--force"), 2, "encoder.plan: no space left on the device",
                              "free some space")
    assert snapshot(work) == before, line


def test_interrupt_between_the_final_renames_puts_the_old_directory_back(work, monkeypatch, snapshot, invoke):
    """Ctrl-C after the old fused/trt was set aside but before the new one took its place."""
    real = os.replace

    def replace(src, dst):
        if str(src).endswith(".partial"):
            raise KeyboardInterrupt
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    before = snapshot(work)
    result = invoke("fuse", work / "out", "--force")
    assert result.exit_code == 130 and "Traceback" not in result.output, result.output
    assert snapshot(work) == before


def test_train_force_interrupted_mid_training_keeps_the_old_checkpoint(work, monkeypatch, snapshot, invoke):
    from seq2trt.reference_model import train as training

    def interrupted(settings, progress):
        progress(1, 1.0)
        raise KeyboardInterrupt

    monkeypatch.setattr(training, "train", interrupted)  # what seq2trt.train (the verb's API function) runs
    before = snapshot(work)
    result = invoke("train", "-o", work / "ckpt", "--preset", "tiny", "--steps", "5", "--force")
    assert result.exit_code == 130 and "interrupted" in result.output, result.output
    assert snapshot(work) == before


def test_full_disk_names_the_file_and_says_the_previous_one_is_intact(work, monkeypatch, snapshot, invoke,
                                                                      one_error_line):
    """The file is named as the artifact's (fused/trt/fusion.json), not by its hidden staging path. The graphs are
    synced too (graph_files.save_graph), so the disk fills at fusion.json's write: its temporary's fsync fails."""
    real = os.fsync

    def fsync(fd):
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(".fusion.json."):
            raising(DISK_FULL)()
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    before = snapshot(work)
    line = one_error_line(invoke("fuse", work / "out", "--force"), 2, "fused/trt/fusion.json: no space left",
                          "the previous fused trt in", "is intact", "free some space")
    assert ".partial" not in line
    monkeypatch.setattr(os, "fsync", real)
    assert snapshot(work) == before


# --- Ctrl-C mid-build, and two builds at once (real processes) ----------------------------------------------------

def plans_match_build_json(engine_dir: Path) -> bool:
    info = json.loads((engine_dir / "build.json").read_text())
    return all(hashlib.sha256((engine_dir / g["plan"]).read_bytes()).hexdigest() == g["plan_sha256"]
               for g in info["graphs"].values()) and len(info["graphs"]) == 2


@pytest.mark.rtx
def test_ctrl_c_mid_build_exits_130_and_keeps_the_old_engines(work, snapshot, seq2trt, signal_while_staging):
    before = snapshot(work)
    proc = seq2trt("build", work / "out", "--force")
    stderr = signal_while_staging(proc, work / "out" / "engines", ".*.partial", signal.SIGINT)
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr and "Traceback" not in stderr
    assert snapshot(work) == before  # old engines intact; no staged directory, lock file or .old left


@pytest.mark.rtx
def test_two_builds_on_the_same_out_take_turns(work, engines, seq2trt):
    out, engine_dir = work / "out", work / "out" / engines
    shutil.rmtree(engine_dir)
    procs = [seq2trt("build", out) for _ in range(2)]  # no --force: exactly one may write the engines
    results = [(p.communicate(timeout=300)[1], p.returncode)[::-1] for p in procs]
    assert sorted(code for code, _ in results) == [0, 2], results
    assert any("already exists" in err and "--force" in err for code, err in results if code == 2)
    assert plans_match_build_json(engine_dir)
    procs = [seq2trt("build", out, "--force") for _ in range(2)]  # both replace it, one after the other
    results = [(p.communicate(timeout=300)[1], p.returncode)[::-1] for p in procs]
    assert [code for code, _ in results] == [0, 0], results
    assert plans_match_build_json(engine_dir)
    assert sorted(p.name for p in (out / "engines").iterdir()) == [engine_dir.name]  # no .partial/.old/.lock
