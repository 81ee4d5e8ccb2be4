"""Carry onnxruntime-gpu to the GPU machine in parts: its ~256 MB wheel is over the 64 MiB one device call may carry.

    python scripts/gpu_check_ort.py split WHEEL PARTS_DIR [--part-mib 56]   # here: PARTS_DIR/part-1 .. part-N
    python scripts/gpu_check_ort.py stage PART_DIR [STORE]                  # there, once per carried part
    python scripts/gpu_check_ort.py assemble [STORE]                        # there: the wheel's path, or why not

`split` writes each part into a folder of its own with a copy of `manifest.json` (the wheel's name, size and sha256,
and each part's), so each device call carries one folder and can check what it brought. `stage` checks a part's
sha256 and copies it into STORE (default /tmp/seq2trt-ort, SEQ2TRT_ORT_STORE): a warm machine keeps /tmp between
calls, while a carried folder is gone from the next call that does not name it. `assemble` joins the parts, checks
the whole wheel's sha256 and prints its path; `scripts/gpu_check.sh` installs it with seq2trt's wheel. Exit status
2 with one line naming what is missing or damaged and the call that brings it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

MANIFEST = "manifest.json"
PART_MIB = 56  # a part, seq2trt's tree (~3 MB) and shared/ stay under the 64 MiB a device call carries
DEFAULT_STORE = "/tmp/seq2trt-ort"


class PartsError(Exception):
    """A part is missing or damaged: the message names it and the call that brings it."""


def store_dir(store: str | Path | None = None) -> Path:
    return Path(store or os.environ.get("SEQ2TRT_ORT_STORE", DEFAULT_STORE))


def _sha256(path: Path) -> str:
    # not seq2trt's atomic_files.sha256_file: a staging call runs before anything is installed (stdlib only)
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def split(wheel: Path, parts_dir: Path, part_mib: int = PART_MIB) -> dict:
    """Cut `wheel` into parts of at most part_mib MiB: parts_dir/part-K/<wheel>.partK, each folder with the manifest."""
    if part_mib <= 0:
        raise ValueError(f"part size must be positive, got {part_mib} MiB")
    size, part_bytes = wheel.stat().st_size, part_mib << 20
    if parts_dir.exists():
        shutil.rmtree(parts_dir)
    parts = []
    with open(wheel, "rb") as f:
        for k in range(1, -(-size // part_bytes) + 1):
            name = f"{wheel.name}.part{k}"
            folder = parts_dir / f"part-{k}"
            folder.mkdir(parents=True)
            data = f.read(part_bytes)
            (folder / name).write_bytes(data)
            parts.append({"folder": folder.name, "name": name, "bytes": len(data),
                          "sha256": hashlib.sha256(data).hexdigest()})
    manifest = {"wheel": wheel.name, "bytes": size, "sha256": _sha256(wheel), "part_mib": part_mib, "parts": parts}
    for part in parts:
        (parts_dir / part["folder"] / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def stage(part_dir: Path, store: Path) -> str:
    """Check one carried part against its manifest and copy it (and the manifest) into the store."""
    manifest_path = part_dir / MANIFEST
    if not manifest_path.is_file():
        raise PartsError(f"{part_dir} holds no {MANIFEST}: carry a folder that scripts/prepare_gpu_check.sh wrote "
                         "(.gpu/ort/part-K)")
    manifest = json.loads(manifest_path.read_text())
    part = next((p for p in manifest["parts"] if p["folder"] == part_dir.name), None)
    if part is None or not (part_dir / part["name"]).is_file():
        raise PartsError(f"{part_dir} is not one of the manifest's parts {[p['folder'] for p in manifest['parts']]}")
    if _sha256(part_dir / part["name"]) != part["sha256"]:
        raise PartsError(f"{part['name']} does not match its sha256: prepare again and carry it again")
    store.mkdir(parents=True, exist_ok=True)
    old = store / MANIFEST
    if old.is_file() and json.loads(old.read_text())["sha256"] != manifest["sha256"]:  # a different wheel's parts
        shutil.rmtree(store)
        store.mkdir(parents=True)
    shutil.copyfile(part_dir / part["name"], store / part["name"])
    shutil.copyfile(manifest_path, store / MANIFEST)
    have = [p["folder"] for p in manifest["parts"] if (store / p["name"]).is_file()]
    return f"staged {part['folder']} of {manifest['wheel']}: {len(have)}/{len(manifest['parts'])} parts in {store}"


def assemble(store: Path) -> Path:
    """The wheel joined from the staged parts, checked against the manifest's sha256."""
    manifest_path = store / MANIFEST
    if not manifest_path.is_file():
        raise PartsError(f"no onnxruntime-gpu parts staged in {store}: run the staging calls of docs/gpu-check.md "
                         "(bash scripts/gpu_check.sh --stage-ort .gpu/ort/part-K, carry [\".gpu/ort/part-K\"]) first")
    manifest = json.loads(manifest_path.read_text())
    wheel = store / manifest["wheel"]
    if wheel.is_file() and wheel.stat().st_size == manifest["bytes"] and _sha256(wheel) == manifest["sha256"]:
        return wheel
    missing = [p["folder"] for p in manifest["parts"]
               if not (store / p["name"]).is_file() or _sha256(store / p["name"]) != p["sha256"]]
    if missing:
        raise PartsError(f"onnxruntime-gpu parts missing or damaged in {store}: {', '.join(missing)}; stage each "
                         "with bash scripts/gpu_check.sh --stage-ort .gpu/ort/<part> (carry that folder)")
    tmp = wheel.with_name(wheel.name + ".tmp")
    with open(tmp, "wb") as out:
        for p in manifest["parts"]:
            with open(store / p["name"], "rb") as f:
                shutil.copyfileobj(f, out)
    if _sha256(tmp) != manifest["sha256"]:
        tmp.unlink()
        raise PartsError(f"the joined {manifest['wheel']} does not match the manifest's sha256: prepare again")
    tmp.replace(wheel)
    return wheel


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpu_check_ort.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("split", help="cut the wheel into parts (here)")
    p.add_argument("wheel", type=Path)
    p.add_argument("parts_dir", type=Path)
    p.add_argument("--part-mib", type=int, default=PART_MIB)
    p = sub.add_parser("stage", help="check one carried part and keep it in the store (there)")
    p.add_argument("part_dir", type=Path)
    p.add_argument("store", nargs="?")
    p = sub.add_parser("assemble", help="join the staged parts and check the wheel (there)")
    p.add_argument("store", nargs="?")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "split":
            manifest = split(args.wheel, args.parts_dir, args.part_mib)
            print(f"{manifest['wheel']} ({manifest['bytes'] / 2**20:.1f} MiB) -> {len(manifest['parts'])} parts "
                  f"of <= {args.part_mib} MiB in {args.parts_dir}")
        elif args.command == "stage":
            print(stage(args.part_dir, store_dir(args.store)))
        else:
            print(assemble(store_dir(args.store)))
    except (PartsError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
