"""Ahead-of-time compilation of the attention kernels to PTX and cubin, with no GPU.

Each variant (kernel x dtype x compiled HEAD_DIM x block config x mask/causal/bias flags, enumerated by
`all_variants` from `launch_plan.block_config`) is compiled with `triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))` for each
target (sm_80, sm_86, sm_89, sm_90). PTX versions stay loadable by a CUDA 13.0 driver (<= 9.0; sm_8x goes through
triton's CUDA 12.9 ptxas, whose limit is 8.8).

Layout of the output directory (also the cache):
    <out>/index.json                  every artifact of the last call: what the TensorRT plugin reads (`read_index`)
    <out>/<target>/<key>.ptx|.cubin   the code; <key> is `launch_plan.variant_key`
    <out>/<target>/<key>.json         its manifest: entry point, shared memory, warps, parameters, constexprs,
                                      pointer/stride divisibility assumptions, sha256 of both files, cache key
An artifact is reused when its manifest's cache key — sha256 of the kernel source, the variant, the target, the
PTX version and the triton version — matches and its files hash as recorded.

Run as `python -m seq2trt.plugins.kernels.aot --out DIR --targets sm_80,sm_90`. Do not import triton with
TRITON_INTERPRET=1 in the same process: the interpreter replaces the compiler.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import logging
import os
import re
import struct
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Callable, Iterable

from seq2trt.plugins.kernels import launch_plan
from seq2trt.core.errors import DependencyError, InputError

logger = logging.getLogger(__name__)

TARGETS = {"sm_80": 80, "sm_86": 86, "sm_89": 89, "sm_90": 90}
# Most shared memory one block may opt into (bytes), per compute capability.
MAX_SHARED = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
MAX_PTX_VERSION = 90  # PTX ISA 9.0 = CUDA 13.0, the newest driver we deploy to
SOURCE = Path(__file__).with_name("attention.py")
COMPILE_OPTIONS = {"enable_fp_fusion": True}  # triton 3.9's default, spelled out so that a change re-keys the cache


def default_dir() -> Path:
    return Path(os.environ.get("SEQ2TRT_KERNEL_DIR", Path.home() / ".cache" / "seq2trt" / "kernels"))


def index_path(out_dir: str | Path | None = None) -> Path:
    """The index of a kernel directory (by default `default_dir()`): what `compile_all` writes and the plugin reads."""
    return Path(out_dir if out_dir is not None else default_dir()) / "index.json"


@dataclass(frozen=True)
class KernelImage:
    """One compiled kernel as the index lists it, for one GPU."""
    key: str
    function: str  # the entry point's mangled name in the image
    image: Path  # cubin for this compute capability, or PTX
    num_warps: int
    shared: int  # dynamic shared memory bytes


def read_index(path: Path, compute_capability: int) -> dict[str, KernelImage]:
    """Kernels for one GPU from an index written by `compile_all`: the cubin built for this compute capability,
    else the PTX of the newest target not above it (the driver JIT-compiles PTX forward, never backward)."""
    root = Path(path).parent
    best: dict[str, tuple[int, KernelImage]] = {}
    for e in json.loads(Path(path).read_text())["kernels"]:
        cc = int(e["target"].removeprefix("sm_"))
        if cc > compute_capability:
            continue
        exact = cc == compute_capability
        rank = 1000 if exact else cc
        if e["key"] in best and best[e["key"]][0] >= rank:
            continue
        if e.get("global_scratch_size", 0):
            raise RuntimeError(f"kernel {e['key']} needs {e['global_scratch_size']} B of global scratch, which the "
                               "plugin's launches pass as null; recompile it without")
        image = root / (e["cubin"] if exact else e["ptx"])
        best[e["key"]] = (rank, KernelImage(e["key"], e["name"], image, int(e["num_warps"]), int(e.get("shared", 0))))
    return {key: image for key, (_, image) in best.items()}


@dataclass(frozen=True)
class Variant:
    kernel: str
    dtype: str
    constexprs: tuple[tuple[str, int], ...]
    num_warps: int
    num_stages: int

    @property
    def key(self) -> str:
        return launch_plan.variant_key(self.kernel, self.dtype, dict(self.constexprs), self.num_warps, self.num_stages)


def _variant(kernel: str, dtype: str, head_dim: int, **flags) -> Variant:
    cfg = launch_plan.block_config(kernel, dtype, head_dim)
    constexprs = {"HEAD_DIM": head_dim, **{k: v for k, v in cfg.items() if k.isupper()}, **flags}
    return Variant(kernel, dtype, tuple(sorted(constexprs.items())), cfg["num_warps"], cfg["num_stages"])


def all_variants() -> list[Variant]:
    """Every variant `launch_plan.plan` can ask for: 3 dtypes x 5 compiled HEAD_DIMs x 10 kernel modes (the two
    attention kernels with and without a position bias for each self-attention kind)."""
    out = []
    for dtype in launch_plan.DTYPES:
        for head_dim in launch_plan.KERNEL_HEAD_DIMS:
            for bias in (0, 1):  # a position bias (T5) on the self-attention kinds; cross-attention takes none
                out += [_variant("attn_fwd", dtype, head_dim, HAS_MASK=1, IS_CAUSAL=0, HAS_BIAS=bias),  # enc self
                        _variant("attn_fwd", dtype, head_dim, HAS_MASK=0, IS_CAUSAL=1, HAS_BIAS=bias),  # dec prefill
                        _variant("attn_decode_split", dtype, head_dim, HAS_MASK=1, APPEND=0, HAS_BIAS=bias),
                        _variant("attn_decode_split", dtype, head_dim, HAS_MASK=0, APPEND=1, HAS_BIAS=bias)]  # step
            out += [_variant("attn_decode_reduce", dtype, head_dim), _variant("kv_append", dtype, head_dim)]
    return out


def parse_kernel_targets(text: str | Iterable[str]) -> list[str]:
    """`"sm_80,sm_90"` (or names) -> ["sm_80", "sm_90"]: targets the kernels compile for (`TARGETS`), in order."""
    names = [t.strip() for t in (text.split(",") if isinstance(text, str) else text) if t.strip()]
    bad = [t for t in names if t not in TARGETS]
    if bad or not names:
        raise InputError(f"unknown target(s) {bad or text!r}; expected a comma-separated subset of {list(TARGETS)}")
    return names


def _triton():
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise DependencyError("TRITON_INTERPRET=1 is set: the interpreter cannot compile; run the ahead-of-time "
                              "compiler in a process without it")
    try:
        import triton
    except ImportError as exc:
        raise DependencyError("compiling the attention kernels needs triton: pip install 'triton>=3.9'") from exc
    return triton


@functools.lru_cache(maxsize=None)
def ptx_version(cc: int) -> int:
    """The PTX ISA version for a target: what triton's ptxas for that target emits, capped at MAX_PTX_VERSION."""
    from triton.backends.nvidia.compiler import get_ptxas, ptx_get_version

    return min(MAX_PTX_VERSION, ptx_get_version(get_ptxas(cc).version))


def cache_key(variant: Variant, target: str, ptx: int, triton_version: str) -> str:
    blob = json.dumps({"source": hashlib.sha256(SOURCE.read_bytes()).hexdigest(), "variant": asdict(variant),
                       "signature": launch_plan.SIGNATURES[variant.kernel], "target": target, "ptx_version": ptx,
                       "triton": triton_version, "divisible": launch_plan.DIVISIBILITY[variant.kernel],
                       "options": COMPILE_OPTIONS},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def cubin_arch(cubin: bytes) -> int:
    """The SM number an ELF cubin is built for (e_flags: bits 0-7 up to ELF ABI v7, bits 8-15 from v8)."""
    if cubin[:4] != b"\x7fELF":
        raise ValueError("not an ELF cubin")
    e_flags = struct.unpack_from("<I", cubin, 48)[0]
    return (e_flags >> 8) & 0xFF if cubin[8] >= 8 else e_flags & 0xFF


def ptx_entry(ptx: str) -> tuple[str, str, int]:
    """(PTX .target, entry point name, parameter count) of a PTX module with one entry."""
    target = re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1)
    m = re.search(r"\.visible \.entry (\w+)\((.*?)\)", ptx, re.S)
    return target, m.group(1), m.group(2).count(".param")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    tmp.replace(path)


def _cached(manifest_path: Path, key: str) -> dict | None:
    try:
        entry = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        return None
    if entry.get("cache_key") != key:
        return None
    for kind in ("ptx", "cubin"):
        path = manifest_path.parent.parent / entry[kind]
        if not path.is_file() or _sha(path.read_bytes()) != entry[f"{kind}_sha256"]:
            return None
    return entry


def _lookup(variant: Variant, target: str, out_dir: Path) -> tuple[str, Path, dict | None]:
    """(cache key, manifest path, the cached manifest or None)."""
    ptx = ptx_version(TARGETS[target])
    key = cache_key(variant, target, ptx, _triton().__version__)
    manifest_path = out_dir / target / f"{variant.key}.json"
    return key, manifest_path, _cached(manifest_path, key)


def _ast_source(variant: Variant):
    """(triton ASTSource, runtime parameters, {name: what it is assumed a multiple of}) of a variant."""
    from triton.compiler import ASTSource

    from seq2trt.plugins.kernels.attention import KERNELS

    fn = KERNELS[variant.kernel]
    params = [(name, ty.format(t=variant.dtype)) for name, ty in launch_plan.SIGNATURES[variant.kernel]]
    constexprs = dict(variant.constexprs)
    if [n for n, _ in params] != [n for n in fn.arg_names if n not in constexprs] or \
            set(constexprs) != set(fn.arg_names) - {n for n, _ in params}:
        raise RuntimeError(f"launch_plan.SIGNATURES[{variant.kernel!r}] and the variant's constexprs do not match the "
                           f"kernel's arguments {fn.arg_names}")
    signature = {name: "constexpr" if name in constexprs else dict(params)[name] for name in fn.arg_names}
    divisible = launch_plan.DIVISIBILITY[variant.kernel]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", d]] for n, d in divisible.items()}
    return ASTSource(fn, signature, constexprs=constexprs, attrs=attrs), params, divisible


def compile_variant(variant: Variant, target: str, out_dir: str | Path) -> dict:
    """Compile one variant for one target into out_dir (or reuse it); returns its manifest plus 'cached'."""
    triton = _triton()
    from triton.backends.compiler import GPUTarget

    cc, out_dir = TARGETS[target], Path(out_dir)
    key, manifest_path, entry = _lookup(variant, target, out_dir)
    if entry is not None:
        return {**entry, "cached": True}
    ptx = ptx_version(cc)
    src, params, divisible = _ast_source(variant)
    start = time.perf_counter()
    compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32),
                              options={"num_warps": variant.num_warps, "num_stages": variant.num_stages,
                                       "ptx_version": ptx, **COMPILE_OPTIONS})
    seconds = time.perf_counter() - start
    md = compiled.metadata
    ptx_text, cubin = compiled.asm["ptx"], compiled.asm["cubin"]
    ptx_target, entry_name, n_params = ptx_entry(ptx_text)
    if n_params != len(params) + len(launch_plan.SCRATCH_PARAMS):
        raise RuntimeError(f"{variant.key}: PTX entry has {n_params} parameters, expected {len(params)} + scratch "
                           f"{launch_plan.SCRATCH_PARAMS}; triton's calling convention changed")
    if md.global_scratch_size or md.profile_scratch_size:
        raise RuntimeError(f"{variant.key} wants global scratch memory, which the plugin's launches pass as null")
    if md.shared > MAX_SHARED[cc]:
        raise RuntimeError(f"{variant.key} needs {md.shared} B of shared memory, {target} allows {MAX_SHARED[cc]}: "
                           "shrink its blocks in launch_plan.block_config")
    (out_dir / target).mkdir(parents=True, exist_ok=True)
    _write(manifest_path.with_suffix(".ptx"), ptx_text.encode())
    _write(manifest_path.with_suffix(".cubin"), cubin)
    entry = {
        "key": variant.key, "name": entry_name, "kernel": variant.kernel, "dtype": variant.dtype,
        "target": target, "ptx_target": ptx_target, "cubin_arch": f"sm_{cubin_arch(cubin)}", "ptx_version": ptx,
        "ptx": f"{target}/{variant.key}.ptx", "cubin": f"{target}/{variant.key}.cubin",
        "ptx_sha256": _sha(ptx_text.encode()), "cubin_sha256": _sha(cubin), "cubin_bytes": len(cubin),
        "num_warps": md.num_warps, "num_stages": md.num_stages, "shared": md.shared, "max_shared": MAX_SHARED[cc],
        "global_scratch_size": md.global_scratch_size, "profile_scratch_size": md.profile_scratch_size,
        "params": params + [(n, "*i8") for n in launch_plan.SCRATCH_PARAMS], "constexprs": dict(variant.constexprs),
        "divisibility": divisible, "triton_version": triton.__version__, "cache_key": key,
        "compile_seconds": round(seconds, 3),
    }
    _write(manifest_path, json.dumps(entry, indent=1).encode())
    return {**entry, "cached": False}


def compile_all(out_dir: str | Path, targets: Iterable[str] = tuple(TARGETS), variants: Iterable[Variant] | None = None,
                progress: Callable[[int, int, dict], None] | None = None, jobs: int | None = None) -> dict:
    """Compile (or reuse) every variant for every target; writes and returns `<out_dir>/index.json`'s content.

    progress(done, total, entry) is called after each artifact. jobs: worker processes (default: CPU count).
    """
    _triton()
    out_dir, targets = Path(out_dir), parse_kernel_targets(targets)
    wanted = [(v, t) for t in targets for v in (all_variants() if variants is None else variants)]
    entries, todo, start = {}, [], time.perf_counter()

    def done(i, entry):
        entries[i] = entry
        if progress is not None:
            progress(len(entries), len(wanted), entry)

    for i, (v, t) in enumerate(wanted):  # cache hits without starting workers
        cached = _lookup(v, t, out_dir)[2]
        if cached is not None:
            done(i, {**cached, "cached": True})
        else:
            todo.append(i)
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(todo)))
    if jobs == 1:
        for i in todo:
            done(i, compile_variant(*wanted[i], out_dir))
    else:  # spawn: workers must not inherit an initialised triton or torch from the caller
        with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
            futures = {pool.submit(compile_variant, *wanted[i], str(out_dir)): i for i in todo}
            for future in as_completed(futures):
                done(futures[future], future.result())
    entries = [entries[i] for i in range(len(wanted))]
    index = {"triton_version": _triton().__version__, "targets": targets, "created": time.time(),
             "seconds": round(time.perf_counter() - start, 3), "kernels": entries}
    out_dir.mkdir(parents=True, exist_ok=True)
    _write(index_path(out_dir), json.dumps(index, indent=1).encode())
    return index


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m seq2trt.plugins.kernels.aot", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=default_dir(), help="output and cache directory")
    parser.add_argument("--targets", default=",".join(TARGETS), help="comma-separated, e.g. sm_80,sm_90")
    parser.add_argument("--kernels", default="", help="only these kernels (comma-separated), default all")
    parser.add_argument("--dtypes", default="", help="only these dtypes (comma-separated), default all")
    parser.add_argument("--head-dims", default="", help="only these head_dims (comma-separated), default all")
    parser.add_argument("--jobs", type=int, default=None, help="worker processes (default: CPU count)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    only = {"kernel": args.kernels, "dtype": args.dtypes, "HEAD_DIM": args.head_dims}
    only = {field: set(filter(None, text.split(","))) for field, text in only.items()}
    variants = [v for v in all_variants()
                if all(not want or str(getattr(v, f, dict(v.constexprs).get(f))) in want for f, want in only.items())]
    if not variants:
        print(f"no variant matches --kernels {args.kernels!r} --dtypes {args.dtypes!r} --head-dims {args.head_dims!r}",
              file=sys.stderr)
        return 2

    def progress(done, total, entry):
        how = "cached" if entry["cached"] else f"{entry['compile_seconds']:.1f}s"
        print(f"[{done}/{total}] {entry['target']} {entry['key']} shared={entry['shared']} {how}", flush=True)

    try:
        index = compile_all(args.out, parse_kernel_targets(args.targets), variants, progress, args.jobs)
    except (InputError, DependencyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    total = sum(e["cubin_bytes"] for e in index["kernels"])
    print(f"{len(index['kernels'])} artifacts ({total / 1e6:.1f} MB of cubin) in {index['seconds']:.1f}s "
          f"-> {index_path(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
