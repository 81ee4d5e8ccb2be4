"""Seeded fuzz of a checkpoint: model.safetensors, config.json and vocab.json, each damaged as bytes or (the JSON
files) as JSON, then loaded. fuzzing.py damages them and judges what came back; conftest.py owns the seeds (a
failure prints its run seed and the command that replays it).
"""

from __future__ import annotations

import json

from seq2trt.reference_model.checkpoint import load_checkpoint


def test_damaged_checkpoint(work, fuzz, outcomes):
    from safetensors.numpy import load_file

    ckpt = work / "ckpt"
    files = ["model.safetensors", "config.json", "vocab.json"]
    originals = {name: (ckpt / name).read_bytes() for name in files}
    baseline, _ = load_checkpoint(ckpt)

    def loaded_right(name: str, how: str):
        def right(result):
            model, vocabs = result
            key = fuzz.damaged_key(how) if name == "config.json" else None
            problem = fuzz.config_problem(model.cfg, baseline.cfg, key)
            if problem:
                return problem
            if name == "model.safetensors":  # no checksum in a checkpoint: the weights must be what the file holds
                stored = load_file(ckpt / name)
                state = model.state_dict()
                if any(not (state[k].numpy() == v).all() for k, v in stored.items() if k in state):
                    return "the loaded weights differ from the file's"
            if vocabs is not None:
                doc = json.loads((ckpt / "vocab.json").read_text())
                for side, vocab in zip(("source", "target"), vocabs):
                    if list(vocab.tokens) != doc[side]["tokens"] or vocab.kind != doc[side]["kind"]:
                        return f"the {side} vocabulary differs from the file's"
                    if vocab.kind not in ("char", "word") or not all(isinstance(t, str) for t in vocab.tokens):
                        return f"the {side} vocabulary holds {vocab.kind!r} / non-string tokens"
            return None
        return right

    for i, (seed, rng) in enumerate(outcomes.cases(5, 90)):
        name = files[i % 3]
        with fuzz.restored(ckpt / name):
            if name.endswith(".json") and i % 2:
                how, damaged = fuzz.mutate_json(originals[name].decode(), rng)
                (ckpt / name).write_text(damaged)
            else:
                how, data = fuzz.mutate_bytes(originals[name], rng)
                (ckpt / name).write_bytes(data)
            outcomes.run(f"{i} {name} {how} [seed {seed}] load", lambda: load_checkpoint(ckpt),
                         loaded_right(name, how))
    outcomes.check(minimum_errors=50)
