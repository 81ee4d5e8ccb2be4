"""Seeded fuzz of `import hf`'s inputs: config.json, generation_config.json and model.safetensors.index.json of a
small sharded BART, damaged as JSON (fuzzing.mutate_json) or with values aimed at what the import reads (sizes,
nulls, non-finite numbers, shard paths: fuzzing.mutate_hf_json). Each case ends in a Seq2TrtError of one line with
nothing written, or in a complete checkpoint that passed its proof against transformers and loads."""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("transformers")

from seq2trt.hf_import import importer as hf_import, proof as hf_verify  # noqa: E402
from seq2trt.reference_model.checkpoint import load_checkpoint  # noqa: E402
from seq2trt.core.errors import Seq2TrtError  # noqa: E402

FILES = ["config.json", "generation_config.json", "model.safetensors.index.json"]


def _sharded_source(make_hf_model, root):
    """A BART saved with generation settings, its weights split over two shards and an index."""
    import json

    from safetensors.torch import load_file, save_file

    src = make_hf_model(root / "a" / "src", "bart", generation=dict(num_beams=2, max_length=20))
    state = load_file(str(src / "model.safetensors"))
    (src / "model.safetensors").unlink()
    keys, weight_map = sorted(state), {}
    for n, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2:]), 1):
        name = f"model-0000{n}-of-00002.safetensors"
        save_file({k: state[k] for k in part}, str(src / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    (src / FILES[2]).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    (root / "x.safetensors").write_bytes((src / "model-00001-of-00002.safetensors").read_bytes())  # ../../ reaches it
    return src


def test_damaged_hf_source(make_hf_model, fuzz, outcomes, tmp_path, monkeypatch):
    # The proof on fewer, shorter sources: the fuzz judges how the files are read, not the proof's breadth.
    monkeypatch.setattr(hf_verify, "judge", functools.partial(hf_verify.judge, count=2, max_new_tokens=6))
    monkeypatch.setattr(hf_import, "physical_memory", lambda: 16 * 2**30)  # the same cases on every machine
    src = _sharded_source(make_hf_model, tmp_path)
    originals = {name: (src / name).read_text() for name in FILES}

    def imported(out):
        def entry():
            try:
                return hf_import.import_hf(src, out)
            except Seq2TrtError as exc:
                left = sorted(p.name for p in out.parent.iterdir() if p.name.startswith((out.name, f".{out.name}")))
                if left or "\n" in str(exc):
                    outcomes.wrong.append(f"{out.name}: refused ({str(exc)[:120]}) but left {left} / a message of "
                                          f"{str(exc).count(chr(10)) + 1} lines")
                raise
        return entry

    def complete(out):
        def right(record):
            names = {p.name for p in out.iterdir()}
            missing = {"config.json", "model.safetensors", "generation.json", "import.json"} - names
            if missing:
                return f"the checkpoint lacks {sorted(missing)}"
            if not record["verification"]["passed"]:
                return "written though its verification failed"
            load_checkpoint(out)
            return None
        return right

    for i, (seed, rng) in enumerate(outcomes.cases(7, 60)):
        name = FILES[i % 3]
        with fuzz.restored(src / name):
            if i % 4 == 3:
                how, damaged = fuzz.mutate_json(originals[name], rng)
            else:
                how, damaged = fuzz.mutate_hf_json(originals[name], rng, name)
            (src / name).write_text(damaged)
            out = tmp_path / f"ckpt{i}"
            outcomes.run(f"{i} {name} {how} [seed {seed}] import", imported(out), complete(out))
    outcomes.check(minimum_errors=30)
