"""The GPU check's steps, declared once: run on the GPU machine, resolved on a CPU (the dry run CI does), and the
device calls that carry what they need. `scripts/gpu_check.sh` is the command; this is its body.

    python scripts/gpu_check_plan.py run OUT_DIR      # every step (SEQ2TRT_GPU_STEPS=a,b: only those), summary.json
    python scripts/gpu_check_plan.py dry-run [--root TREE]  # resolve all a run would use; exit 1 naming what is not
    python scripts/gpu_check_plan.py calls            # the device calls, in order, with what each carries

A step is a command line with placeholders: {py} this Python, {root} the source tree, {out} the output folder and
the prepared inputs of `PREPARED` ({ckpt}, {kernels}). The dry run resolves each one: its script exists and its
subcommand, flags and arity parse; every `seq2trt` module and name the script imports (and the sibling scripts it
imports) exists; a `seq2trt` CLI verb, its flags and their choices exist; the pytest step's files collect, with at
least one `gpu`-marked test each and every `gpu`-marked test file of the suite among them; the prepare steps'
modules and flags; and docs/gpu-check.md still spells each device call this module makes.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent  # where a step's "scripts/..." is found: beside this file
ROOT = SCRIPTS.parent  # the source tree: tests, docs, prepared inputs (dry-run --root moves it, for planted copies)
PREPARED = {"ckpt": ".gpu/ckpt", "kernels": ".gpu/kernels/index.json", "wheels": ".whl", "ort_parts": ".gpu/ort"}
CARRY_LIMIT = 64 << 20  # bytes one device call may carry, the working tree included
DOC = "docs/gpu-check.md"
STAGE_COMMAND = "bash scripts/gpu_check.sh --stage-ort {part}"
CHECK_COMMAND = ("bash scripts/gpu_check.sh /tmp/gc; rc=$?; "
                 "tar czf $OUT/gpu_check.tgz -C /tmp/gc --exclude=./export .; exit $rc")
CHECK_CARRY = (".whl", ".gpu/ckpt", ".gpu/kernels")


@dataclass(frozen=True)
class Step:
    name: str
    limit_s: int
    argv: tuple[str, ...]
    needs: tuple[str, ...] = ()  # PREPARED inputs without which the step is recorded as skipped
    if_present: dict = field(default_factory=dict)  # PREPARED input -> arguments added when it was carried
    env: dict = field(default_factory=dict)


def gpu_test_files(root: Path = ROOT) -> list[str]:
    """Every test file of the suite with a `gpu`-marked test: the gpu_tests step runs them all, so a moved or new
    GPU test is run (or, collected by the dry run, fails CI) rather than silently left out."""
    return sorted(str(p.relative_to(root)) for p in (root / "tests").rglob("test_*.py")
                  if "pytest.mark.gpu" in p.read_text(errors="replace"))


# In order of what a short lease most needs (a run stops starting steps when its budget is spent).
STEPS = (
    Step("env", 60, ("{py}", "scripts/gpu_check.py", "env", "{out}/env.json")),
    # T5's position-bias kernels against SDPA with a dense additive bias, interleaved: the ratio per case
    Step("bias_speed", 180, ("{py}", "scripts/gpu_kernels.py", "{out}/bias_speed", "--bias-speed-only")),
    # T5 and Whisper end to end on CUDA against transformers' generate on the same GPU: the eager model, with our
    # kernels (JIT, and the AOT cubins when carried).
    Step("families", 240, ("{py}", "scripts/gpu_check_families.py", "{out}/families.json"),
         if_present={"kernels": ("--aot-index", "{kernels}")}),
    # ONNX Runtime's CUDA provider (the `ort-cuda` backend, the cache on the GPU) against transformers' generate in
    # reduced precision on the same GPU: whisper-base and flan-t5-base shapes, greedy and beam, B=1 and 32.
    Step("ort_cuda", 240, ("{py}", "{root}/benchmarks/gpu_runtime.py", "--out", "{out}/gpu_runtime", "--repeats", "3")),
    Step("pipeline", 180, ("{py}", "scripts/gpu_check.py", "pipeline", "{ckpt}", "{out}/export", "{out}/validate.json"),
         needs=("ckpt",)),
    Step("kernels", 300, ("{py}", "scripts/gpu_kernels.py", "{out}/kernels", "--no-bias-speed"),
         if_present={"kernels": ("--aot-index", "{kernels}")}),
    # The suite's gpu-marked tests; the kernel sweep's test reads the kernels step's report instead of redoing it.
    Step("gpu_tests", 300, ("{py}", "-m", "pytest", "-q", "-rs", "-m", "gpu", "-p", "no:cacheprovider", "-p",
                            "no:benchmark", "--junitxml={out}/gpu_tests.xml", "{gpu_tests}"),
         env={"SEQ2TRT_GPU_KERNELS_REPORT": "{out}/kernels/gpu_kernels.json",
              "SEQ2TRT_GPU_BIAS_REPORT": "{out}/bias_speed/gpu_kernels.json"}),
    Step("eager_cuda", 180, ("{py}", "scripts/gpu_check.py", "eager", "{ckpt}", "{out}/eager_cuda.json"),
         needs=("ckpt",), if_present={"kernels": ("{kernels}",)}),
    Step("bench", 180, ("{py}", "scripts/gpu_check.py", "bench", "{ckpt}", "{out}/export", "{out}/bench.json"),
         needs=("ckpt",)),
    Step("tensorrt", 60, ("{py}", "scripts/gpu_check.py", "tensorrt", "{out}/tensorrt.json")),
)
BUDGET_S = 480  # a whole run (SEQ2TRT_GPU_BUDGET_S): inside the device call's 540 s, with the install and the tar
MIN_STEP_S = 20
# What scripts/prepare_gpu_check.sh runs here (no GPU), resolved by the dry run like the steps.
PREPARE = (
    ("wheel", ("{py}", "-m", "pip", "wheel", "-q", "--no-deps", "-w", ".whl", ".")),
    ("checkpoint", ("{py}", "scripts/gpu_check.py", "checkpoint", ".gpu/ckpt")),
    ("kernels", ("{py}", "-m", "seq2trt.plugins.kernels.aot", "--targets", "sm_90", "--out", ".gpu/kernels")),
    ("ort_parts", ("{py}", "scripts/gpu_check_ort.py", "split", "{ort_wheel}", ".gpu/ort")),
)


def expand(argv, root: Path, out: Path) -> list[str]:
    values = {"py": sys.executable, "root": str(root), "out": str(out),
              **{k: str(root / v) for k, v in PREPARED.items()}, "ort_wheel": str(root / ".gpu/onnxruntime_gpu.whl")}
    args = []
    for a in argv:
        if a == "{gpu_tests}":
            args += [str(root / f) for f in gpu_test_files(root)]
        elif a.startswith("scripts/"):
            args.append(str(SCRIPTS / a.removeprefix("scripts/")))
        else:
            args.append(a.format(**values))
    return args


def step_argv(step: Step, root: Path, out: Path) -> list[str]:
    argv = list(step.argv)
    for key, extra in step.if_present.items():
        if (root / PREPARED[key]).exists():
            argv += extra
    return expand(argv, root, out)


# --- running (the GPU machine) ------------------------------------------------------------------------------------

def run(out: Path, root: Path = ROOT) -> int:
    only = {s for s in os.environ.get("SEQ2TRT_GPU_STEPS", "").split(",") if s}
    unknown = only - {s.name for s in STEPS}
    if unknown:
        print(f"SEQ2TRT_GPU_STEPS names unknown steps {sorted(unknown)}; steps: {[s.name for s in STEPS]}")
        return 2
    out.mkdir(parents=True, exist_ok=True)
    summary, deadline = {}, time.monotonic() + float(os.environ.get("SEQ2TRT_GPU_BUDGET_S", BUDGET_S))
    for step in STEPS:
        missing = [PREPARED[k] for k in step.needs if not (root / PREPARED[k]).exists()]
        left = deadline - time.monotonic()
        why = "not chosen" if only and step.name not in only else f"not carried: {missing}" if missing else \
            f"the run's budget is spent ({left:.0f}s left)" if left < MIN_STEP_S else None
        if why:
            summary[step.name] = {"status": "skipped", "why": why}
            continue
        print(f"== {step.name}", flush=True)
        start, log = time.monotonic(), out / f"{step.name}.log"
        env = {**os.environ, **{k: v.format(out=out) for k, v in step.env.items()}}
        with open(log, "w") as f:
            try:
                limit = min(step.limit_s, left)
                rc = subprocess.run(step_argv(step, root, out), stdout=f, stderr=subprocess.STDOUT, env=env,
                                    timeout=limit).returncode
            except subprocess.TimeoutExpired:
                rc = f"timed out after {limit:.0f}s"
        summary[step.name] = {"status": rc, "seconds": round(time.monotonic() - start, 1)}
        lines = log.read_text(errors="replace").splitlines()
        print("\n".join(lines if len(lines) <= 40 else lines[-5:]), flush=True)  # the device tool returns the tail
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return int(any(s["status"] not in (0, "skipped") for s in summary.values()))


# --- resolving (the dry run, on a CPU) ----------------------------------------------------------------------------

def _load_script(path: Path):
    spec = importlib.util.spec_from_file_location(f"_gpu_check_script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


def resolve_imports(path: Path, seen: set | None = None) -> list[str]:
    """Every `seq2trt` module and name the script imports, anywhere in it, and the sibling scripts it imports."""
    seen = set() if seen is None else seen
    if path in seen:
        return []
    seen.add(path)
    problems = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [(a.name, None) for a in node.names] if isinstance(node, ast.Import) else \
            [(node.module, [a.name for a in node.names])] if isinstance(node, ast.ImportFrom) and node.module else []
        for module, attrs in names:
            sibling = path.parent / f"{module.split('.')[0]}.py"
            if sibling.is_file():
                problems += resolve_imports(sibling, seen)
            elif module.split(".")[0] == "seq2trt":
                try:
                    loaded = importlib.import_module(module)
                except Exception as exc:  # noqa: BLE001  named, whatever the cause
                    problems.append(f"{path.name}: import {module}: {type(exc).__name__}: {exc}")
                    continue
                problems += [f"{path.name}: {module} has no {a!r}" for a in attrs or ()
                             if a != "*" and not hasattr(loaded, a) and not (  # a submodule of a package is fine
                                 hasattr(loaded, "__path__") and importlib.util.find_spec(f"{module}.{a}"))]
    return problems


def resolve_args(module, args: list[str], where: str) -> list[str]:
    """A script's or module's arguments against its own parser (`build_parser`) or subcommand table (`COMMANDS`)."""
    if hasattr(module, "COMMANDS"):
        if not args or args[0] not in module.COMMANDS:
            return [f"{where}: no subcommand {args[:1]}; it has {sorted(module.COMMANDS)}"]
        try:
            inspect.signature(module.COMMANDS[args[0]]).bind(*args[1:])
        except TypeError as exc:
            return [f"{where} {args[0]}: {exc}"]
        return []
    if hasattr(module, "build_parser"):
        try:
            module.build_parser().parse_args(args)
        except SystemExit:
            return [f"{where}: its parser refuses {args}"]
        return []
    return [f"{where}: has neither build_parser() nor COMMANDS, so its arguments cannot be checked"]


def resolve_cli(args: list[str]) -> list[str]:
    """`seq2trt VERB ... --flag value`: the verb path, each flag, and a flag's value where it has fixed choices."""
    import click

    from seq2trt.cli.main import cli

    command, rest, path = cli, list(args), ["seq2trt"]
    while isinstance(command, click.Group) and rest and not rest[0].startswith("-"):
        ctx = click.Context(command)
        name = rest.pop(0)
        sub = command.get_command(ctx, name)
        if sub is None:
            return [f"{' '.join(path)} has no verb {name!r}; it has {sorted(command.list_commands(ctx))}"]
        command, path = sub, path + [name]
    options = {opt: p for p in command.params if isinstance(p, click.Option) for opt in p.opts + p.secondary_opts}
    problems = []
    for i, token in enumerate(rest):
        flag = token.split("=", 1)[0]
        if not flag.startswith("--"):
            continue
        if flag not in options:
            problems.append(f"{' '.join(path)} has no option {flag}")
            continue
        param = options[flag]
        value = token.split("=", 1)[1] if "=" in token else rest[i + 1] if i + 1 < len(rest) else None
        if isinstance(param.type, click.Choice) and value is not None and not param.is_flag:
            bad = [v for v in value.split(",") if v not in param.type.choices]
            if bad and value not in param.type.choices:
                problems.append(f"{' '.join(path)} {flag}: {bad} not among {list(param.type.choices)}")
    return problems


def resolve_pytest(args: list[str], root: Path) -> tuple[list[str], list[str]]:
    """(problems, node ids) of a pytest command line: collected with its own options (a report file aside), the
    files exist and collect without errors, each with >= 1 selected test, and together they hold every
    gpu-marked test file of the suite."""
    files = [a for a in args if a.endswith(".py")]
    options = [a for a in args if not a.endswith(".py") and a != "-q" and not a.startswith("--junitxml")]
    missing = [f for f in files if not Path(f).is_file()]
    if missing:
        return [f"gpu_tests: no such test file {f}" for f in missing], []
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", *options, *files],
                          cwd=root, capture_output=True, text=True, timeout=600)
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    problems = [] if proc.returncode == 0 else [f"gpu_tests: collection failed (exit {proc.returncode}):\n"
                                                f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}"]
    for f in files:
        rel = str(Path(f).resolve().relative_to(root))
        if not any(i.startswith(rel + "::") for i in ids):
            problems.append(f"gpu_tests: {rel} collects no gpu-marked test")
    wanted = {str(root / f) for f in gpu_test_files(root)}
    problems += [f"gpu_tests: {f} has gpu-marked tests but the step does not run it" for f in wanted - set(files)]
    return problems, ids


def resolve_command(name: str, argv: list[str], root: Path) -> list[str]:
    """One command line of a step or a prepare step."""
    if argv[1:3] == ["-m", "pytest"]:
        problems, ids = resolve_pytest(argv[3:], root)
        print(f"    {len(ids)} gpu-marked tests collected")
        return problems
    if argv[1] == "-m":
        module_name, args = argv[2], argv[3:]
        if module_name == "pip":
            return []
        if module_name == "seq2trt.cli.main":
            return resolve_cli(args)
        if importlib.util.find_spec(module_name) is None:
            return [f"{name}: no module {module_name}"]
        return resolve_args(importlib.import_module(module_name), args, f"{name}: python -m {module_name}")
    script = Path(argv[1])
    if not script.is_file():
        return [f"{name}: no such script {script}"]
    problems = resolve_imports(script)
    try:
        module = _load_script(script)
    except Exception as exc:  # noqa: BLE001
        return problems + [f"{name}: {script.name} does not load: {type(exc).__name__}: {exc}"]
    return problems + resolve_args(module, argv[2:], f"{name}: {script.name}")


def dry_run(root: Path = ROOT) -> list[str]:
    """Everything a run and its preparation would use, resolved here; the problems found (none: all resolve)."""
    out, problems = Path("/nonexistent-gpu-check-out"), []
    for step in STEPS:
        argv = expand(list(step.argv) + [a for extra in step.if_present.values() for a in extra], root, out)
        found = resolve_command(step.name, argv, root)
        print(f"{'ok ' if not found else 'BAD'} step {step.name}: {' '.join(argv[1:])[:160]}")
        problems += found
    for name, argv in PREPARE:
        found = resolve_command(f"prepare {name}", expand(argv, root, out), root)
        print(f"{'ok ' if not found else 'BAD'} prepare {name}")
        problems += found
    for script in ("gpu_check.sh", "prepare_gpu_check.sh", "gpu_check_ort.py"):
        if not (SCRIPTS / script).is_file():
            problems.append(f"no such script scripts/{script}")
    problems = list(dict.fromkeys(problems))  # a script several steps run is named once
    doc = (root / DOC).read_text() if (root / DOC).is_file() else ""
    for command in (CHECK_COMMAND, STAGE_COMMAND.format(part=".gpu/ort/part-1")):
        if command not in doc:
            problems.append(f"{DOC} does not spell the device call `{command}`")
    return problems


# --- the device calls ---------------------------------------------------------------------------------------------

def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else \
        path.stat().st_size if path.is_file() else 0


def device_calls(root: Path = ROOT) -> list[dict]:
    """The device tool's calls, in order: one staging call per onnxruntime-gpu part, then the check (which also
    takes the last part when it fits). Each with the bytes it carries beside the tracked tree."""
    parts = sorted((root / PREPARED["ort_parts"]).glob("part-*"), key=lambda p: int(p.name.split("-")[1]))
    check_bytes = sum(_bytes(root / c) for c in CHECK_CARRY)
    tracked = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True).stdout.splitlines()
    tree = sum((root / f).stat().st_size for f in tracked if (root / f).is_file())
    last = [] if not parts or tree + check_bytes + _bytes(parts[-1]) > CARRY_LIMIT else [parts[-1]]
    calls = [{"command": STAGE_COMMAND.format(part=p.relative_to(root)), "carry": [str(p.relative_to(root))],
              "bytes": tree + _bytes(p), "timeout_s": 120} for p in parts if p not in last]
    calls.append({"command": CHECK_COMMAND, "carry": list(CHECK_CARRY) + [str(p.relative_to(root)) for p in last],
                  "bytes": tree + check_bytes + sum(_bytes(p) for p in last), "timeout_s": 540})
    return calls


def main(argv: list[str]) -> int:
    if argv[:1] == ["run"] and len(argv) == 2:
        return run(Path(argv[1]).resolve())
    if argv[:1] == ["dry-run"] and len(argv) in (1, 3) and argv[1:2] in ([], ["--root"]):
        problems = dry_run(Path(argv[2]).resolve() if len(argv) == 3 else ROOT)
        for p in problems:
            print(f"error: {p}")
        print(f"dry run: {'ok' if not problems else f'{len(problems)} problem(s)'}")
        return int(bool(problems))
    if argv == ["calls"]:
        calls = device_calls()
        unprepared = [c for c in CHECK_CARRY if not (ROOT / c).exists()]
        if unprepared or not (ROOT / PREPARED["ort_parts"]).is_dir():
            print(f"note: not prepared here yet ({', '.join(unprepared) or PREPARED['ort_parts']}): run "
                  "scripts/prepare_gpu_check.sh first; the calls below lack what it makes")
        for i, call in enumerate(calls, 1):
            over = "  OVER THE 64 MiB LIMIT" if call["bytes"] > CARRY_LIMIT else ""
            print(f"{i}. run(command={call['command']!r}, carry={json.dumps(call['carry'])}"
                  f"{', timeout_s=' + str(call['timeout_s']) if 'timeout_s' in call else ''})  "
                  f"# {call['bytes'] / 2**20:.1f} MiB{over}")
        return int(any(c["bytes"] > CARRY_LIMIT for c in calls))
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
