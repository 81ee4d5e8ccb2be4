"""Seeded fuzz of an export's JSON records: manifest.json (verify, fuse, build, report, validate), fusion.json
(build, report) and build.json (the engine check, report). fuzzing.py damages them and judges what came back;
conftest.py owns the seeds (a failure prints its run seed and the command that replays it). TensorRT's compile is
stubbed (`stub_build`): every check of the files a build reads still runs.
"""

from __future__ import annotations

import json

import pytest

from seq2trt.exporters.fuse import FUSION_JSON, Target, fuse_artifacts, fused_dir
from seq2trt.exporters.manifest import verify
from seq2trt.exporters.tensorrt.engines import BUILD_JSON, read_build
from seq2trt.exporters.tensorrt import trt_compat
from seq2trt.core.errors import ArtifactError
from seq2trt.validation.reports.report import write_report


# Damage the seeded cases may or may not draw, always run: the escaped crashes (KeyError without settings.limits,
# TypeError with a list in dtype) and a config value of the wrong type that once loaded (pre_norm 1.5).
KNOWN_MANIFEST_DAMAGE = [
    ("settings without limits", lambda d: d["settings"].pop("limits")),
    ("dtype a list", lambda d: d.__setitem__("dtype", ["fp32"])),
    ("dtype an object", lambda d: d.__setitem__("dtype", {"a": None})),
    ("settings a list", lambda d: d.__setitem__("settings", [1, "a"])),
    ("limits with an unknown key", lambda d: d["settings"]["limits"].__setitem__("x", 2)),
    ("limits a string", lambda d: d["settings"].__setitem__("limits", "x")),
    ("config a list", lambda d: d.__setitem__("config", [])),
    ("config.pre_norm 1.5", lambda d: d["config"].__setitem__("pre_norm", 1.5)),
    ("config.d_model 1.5", lambda d: d["config"].__setitem__("d_model", 1.5)),
    ("config.suppress_ids a string", lambda d: d["config"].__setitem__("suppress_ids", "x")),
    ("files a list", lambda d: d.__setitem__("files", [])),
]


@pytest.mark.parametrize("how, damage", KNOWN_MANIFEST_DAMAGE, ids=[k for k, _ in KNOWN_MANIFEST_DAMAGE])
def test_known_manifest_damage_is_one_artifact_error(work, how, damage):
    path = work / "out" / "manifest.json"
    doc = json.loads(path.read_text())
    damage(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match="is malformed"):
        verify(work / "out")


def test_damaged_manifest(work, stub_build, quick_validation, fuzz, outcomes):
    out = work / "out"
    baseline = verify(out)
    fuse_artifacts(out, Target.ORT, force=True)
    fused = (fused_dir(out, Target.ORT) / FUSION_JSON).read_text()
    built = fuzz.build_record(stub_build(out))
    report = write_report(out)[0].read_text()

    def same_manifest(key: str | None):
        def right(m):
            if (m.dtype, m.limits, m.data["files"]) != (baseline.dtype, baseline.limits, baseline.data["files"]):
                return f"dtype / limits / files read as {m.dtype!r} / {m.limits} / {m.data['files']}"
            return fuzz.config_problem(m.config, baseline.config, key)
        return right

    cases = [(f"known {how} (resealed)", damage) for how, damage in KNOWN_MANIFEST_DAMAGE]
    text = (out / "manifest.json").read_text()
    for i, (seed, rng) in enumerate(outcomes.cases(2, 60)):
        how, damaged = fuzz.mutate_json(text, rng)
        if i % 2:  # half keep the old checksum: it must catch them; half are resealed so the damage reaches the stages
            damaged, how = fuzz.resealed(damaged), how + " (resealed)"
        cases.append((f"{how} [seed {seed}]", damaged))
    for i, (how, damage) in enumerate(cases):
        with fuzz.restored(out / "manifest.json"):
            if callable(damage):
                doc = json.loads(text)
                damage(doc)
                damage = fuzz.resealed(json.dumps(doc))
            (out / "manifest.json").write_text(damage)
            case, key = f"{i} manifest {how}", fuzz.damaged_key(how, ("config",))
            outcomes.run(case + " verify", lambda: verify(out), same_manifest(key))
            outcomes.run(case + " fuse", lambda: fuse_artifacts(out, Target.ORT, force=True),
                         lambda _: None if (fused_dir(out, Target.ORT) / FUSION_JSON).read_text() == fused
                         else "fusion.json differs from the undamaged run's")
            outcomes.run(case + " build", lambda: stub_build(out),
                         lambda engines: None if fuzz.build_record(engines) == built
                         else "build.json differs from the undamaged run's")
            outcomes.run(case + " report", lambda: write_report(out),
                         fuzz.same_report(out, report, {"Model and export", "Engines"}))
            if i % 6 == 0:
                with fuzz.folder_kept(out / "reports"):
                    outcomes.run(case + " validate", lambda: quick_validation(out), fuzz.nothing_to_check)
    outcomes.check(minimum_errors=60)


def test_damaged_fusion_json(work, stub_build, fuzz, outcomes):
    out = work / "out"
    built = fuzz.build_record(stub_build(out))
    report = write_report(out)[0].read_text()
    for i, how in fuzz.damaged_json(fused_dir(out, Target.TRT) / FUSION_JSON, outcomes.cases(3, 40)):
        outcomes.run(f"{i} fusion.json {how} build", lambda: stub_build(out),
                     lambda engines: None if fuzz.build_record(engines) == built
                     else "build.json differs from the undamaged run's")
        outcomes.run(f"{i} fusion.json {how} report", lambda: write_report(out),
                     fuzz.same_report(out, report, {"Fusion"}))
    outcomes.check(minimum_errors=15)


@pytest.mark.rtx  # the engines conftest.artifact builds with tensorrt_rtx
def test_damaged_build_json(work, engines, fuzz, outcomes):
    out = work / "out"
    engine_dir = out / engines
    report = write_report(out)[0].read_text()

    def fit_here(_):  # what check_engine decides, from build.json as it stands (written independently)
        doc = json.loads((engine_dir / BUILD_JSON).read_text())
        targets = doc.get("targets", [])  # build.json written before compute_capabilities: the int targets
        compute = doc.get("compute_capabilities", [t for t in targets if isinstance(t, int)]
                          if isinstance(targets, list) else [])
        fits = (doc.get("flavour") == "tensorrt-rtx" and str(doc.get("tensorrt_version", "")).split(".")[:2] == ["1", "7"]
                and isinstance(compute, list) and 86 in compute)
        return None if fits else "check_engine accepted a build.json that does not fit tensorrt-rtx 1.7 on sm_86"

    for i, how in fuzz.damaged_json(engine_dir / BUILD_JSON, outcomes.cases(4, 40)):
        case = f"{i} build.json {how}"
        outcomes.run(case + " engine check", lambda: trt_compat.check_engine(
            read_build(engine_dir), "tensorrt-rtx", "1.7.1.116", 86), fit_here)
        outcomes.run(case + " report", lambda: write_report(out), fuzz.same_report(out, report, {"Engines"}))
    outcomes.check(minimum_errors=15)
