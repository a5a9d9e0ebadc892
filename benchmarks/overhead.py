"""What tracing costs: one training step under each tool, as a ratio to the plain step.

Every configuration runs the same model and the same step (zero_grad, forward, backward,
AdamW step) in the same process; the configurations take turns within every repeat, so drift
of the machine (clock, caches, other load) falls on all of them alike. Each timed step includes
entering and leaving the tool's context manager, i.e. the trace's finalisation (waiting for its
checksums) and the profiler's event processing.

    python benchmarks/overhead.py                          # tiny GPT-2 on the CPU
    python benchmarks/overhead.py --model gpt2-small       # the real 124M config, random init
    python benchmarks/overhead.py --model llama            # Llama-style, 12 layers, d=768, GQA 12/4
    python benchmarks/overhead.py --model resnet50         # ResNet-50, cross-entropy on 1000 labels
    python benchmarks/overhead.py --device cuda --repeats 20
    python benchmarks/overhead.py --suite --device cuda    # the three workloads and ViT-Base, one table each

``µs/call`` is the time added to the step divided by the number of API calls the trace records
in one step (the same count for every row, so the rows compare). ``body ms`` is the time until
the step's own code returned, before the tool's exit and the final synchronisation: on a GPU,
the CPU time spent issuing the step. While it stays below the GPU's time, the CPU work a tool
adds is hidden behind the GPU's; above it, every added microsecond shows.

``--suite`` times, per workload and in one process, gradtrace's rows, the ``floor.py`` rows
(its hook points doing nothing) and PyTorch's own tools side by side; ``recorder share`` is a
gradtrace row's ratio minus the ratio of the floor row ``+ Python node hooks`` (the recorder's
own bookkeeping above its hook points). Each workload also gets the first traced step of a
fresh process (a subprocess) against a later traced step, the copy + MD5 limit of the step's
bytes, and on the CPU the recorder's microseconds per recorded object.

On CUDA the forward runs under bf16 autocast by default (``--autocast``), as real training does.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch

import tracer
from tracer.record.checksums.launcher import WARMUP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# Re-exported: the other scripts of this folder import the workloads from here too.
from workloads import (  # a sibling script, not a package
    CLOCKS,
    LARGE_MODELS,
    MODELS,
    Factory,
    Workload,
    build,
    default_workload,
    recorded_bytes,
    recorded_objects,
    time_step,
    use_clock,
)

__all__ = ["Workload", "build", "configurations", "default_workload", "main", "time_step"]

# Row kinds: the plain step, gradtrace, floor.py's hook points doing nothing, PyTorch's own tools.
PLAIN, GRADTRACE, FLOOR, PEER = "plain", "gradtrace", "floor", "peer"
# The floor row a gradtrace row's "recorder share" is measured against: the hook points that
# row uses. A trace without checksums or stats hooks no built-in grad node (node_runs), so its
# floor is the walk to each call's new nodes; the others hook every node.
SHARE_FLOOR = "floor-hooks"
LEAN_FLOOR = "floor-walk"
# The node walk plus the least a Python recorder keeps per object (floor.py's _RecordsMode).
RECORDS_FLOOR = "floor-records"
LEAN_ROWS = frozenset({"nostacks", "stacks", "stacks-ops"})
FLOOR_KEYS = ("floor-mode", "floor-modules", LEAN_FLOOR, SHARE_FLOOR)


def share_floor(key: str) -> str:
    """The floor row matching the gradtrace row ``key`` (see LEAN_FLOOR)."""
    return LEAN_FLOOR if key in LEAN_ROWS else SHARE_FLOOR


def _floor_rows() -> dict[str, Factory]:
    from floor import hook_point_rows  # a sibling script; imported late, it imports workloads

    return hook_point_rows()


def configurations(device: torch.device) -> dict[str, tuple[str, Factory]]:
    """key -> (row label, context manager factory), in table order (``--configs`` picks rows).

    ``fast`` is the on-device fingerprint instead of MD5; ``stats``/``md5-nostats`` split the
    md5 row's cost into the per-tensor stats and the checksums themselves; ``floor-*`` are
    ``floor.py``'s hook points doing nothing.
    """
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    floor = _floor_rows()
    return {
        "plain": ("plain", contextlib.nullcontext),
        "nostacks": ('trace(hash="none", stacks=False)', lambda: tracer.trace(hash="none", stacks=False)),
        "stacks": ('trace(hash="none", stacks=True)', lambda: tracer.trace(hash="none", stacks=True)),
        # The same with every grad node's run recorded (what hash="none" did before node_runs).
        "stacks-runs": ('trace(hash="none", node_runs=True)', lambda: tracer.trace(hash="none", node_runs=True)),
        "md5": ('trace(hash="md5")', lambda: tracer.trace(hash="md5")),
        "fast": ('trace(hash="fast")', lambda: tracer.trace(hash="fast")),
        "anomaly": ("detect_anomaly(check_nan=True)", lambda: torch.autograd.detect_anomaly(check_nan=True)),
        "profiler": ("profiler(record_shapes, with_stack)", lambda: torch.profiler.profile(
            activities=activities, record_shapes=True, with_stack=True)),
        "stats": ('trace(hash="none", stats=True)', lambda: tracer.trace(hash="none", stats=True)),
        "numerics": ('trace(hash="none", check_numerics=True)',
                     lambda: tracer.trace(hash="none", check_numerics=True)),
        "check_numerics": ("tracer.check_numerics()", lambda: tracer.check_numerics()),
        "check_numerics-state": ("tracer.check_numerics(optimizer_state=True)",
                                 lambda: tracer.check_numerics(optimizer_state=True)),
        "explain": ("tracer.explain_errors()", lambda: tracer.explain_errors()),
        "debugmode": ('DebugMode + log_tensor_hashes (private)', _debug_mode_with_hashes),
        "debugmode-stacks": ("DebugMode(record_stack_trace=True) (private)", _debug_mode_with_stacks),
        "md5-nostats": ('trace(hash="md5", stats=False)', lambda: tracer.trace(hash="md5", stats=False)),
        # Every op inside optimizer.step() recorded, as before the step became one call.
        "stacks-ops": ('trace(hash="none", optimizer_ops=True)',
                       lambda: tracer.trace(hash="none", optimizer_ops=True)),
        "fast-ops": ('trace(hash="fast", optimizer_ops=True)', lambda: tracer.trace(hash="fast", optimizer_ops=True)),
        "floor-mode": ("floor: empty TorchFunctionMode", floor["mode"]),
        "floor-modules": ("floor: mode + module hooks", floor["mode+modules"]),
        "floor-walk": ("floor: + node walk", floor["+node walk"]),
        SHARE_FLOOR: ("floor: + Python node hooks", floor["+Python node hooks"]),
        RECORDS_FLOOR: ("floor: + minimal records", floor["+minimal records"]),
    }


def kind(key: str) -> str:
    if key == "plain":
        return PLAIN
    if key.startswith("floor-"):
        return FLOOR
    if key in ("anomaly", "profiler") or key.startswith("debugmode"):
        return PEER
    return GRADTRACE


DEFAULT_CONFIGS = "plain,nostacks,stacks,md5,fast,numerics,anomaly,profiler,debugmode"
# gradtrace's rows, the floor rows, then PyTorch's own tools.
SUITE_CONFIGS = ("plain,nostacks,stacks,stacks-runs,fast,check_numerics,md5,floor-modules,floor-walk,floor-hooks,"
                 "floor-records,"
                 "anomaly,profiler,debugmode,debugmode-stacks")
# The three workloads the targets are set on, and ViT-Base beside them as a family they were not
# measured on (issue 44: a figure must hold there too).
SUITE_MODELS = {"cuda": "gpt2-small,llama,resnet50,vit", "cpu": "tiny12,llama-tiny,resnet50-tiny,vit-tiny"}
# The rows of the "first traced step" table (each in a fresh process).
FIRST_STEP_CONFIGS = "fast,check_numerics"


@contextlib.contextmanager
def _debug_mode_with_hashes() -> Iterator[None]:
    """PyTorch's own DebugMode hashing every op output (private API: skipped where absent)."""
    from torch.utils._debug_mode import DebugMode

    with DebugMode(), DebugMode.log_tensor_hashes(hash_fn="norm"):
        yield


@contextlib.contextmanager
def _debug_mode_with_stacks() -> Iterator[None]:
    """PyTorch's own DebugMode logging every op with the Python stack of its forward call
    (private API: skipped where absent). It turns anomaly mode on for the forward stacks."""
    from torch.utils._debug_mode import DebugMode

    with DebugMode(record_stack_trace=True):
        yield


def debug_mode_missing(key: str) -> str | None:
    """Why the DebugMode row ``key`` cannot run in this torch, or None when it can."""
    try:
        from torch.utils._debug_mode import DebugMode
    except ImportError:
        return f"torch {torch.__version__} has no torch.utils._debug_mode.DebugMode"
    if key == "debugmode" and not hasattr(DebugMode, "log_tensor_hashes"):
        return f"torch {torch.__version__}'s DebugMode has no log_tensor_hashes"
    if key == "debugmode-stacks":
        import inspect

        if "record_stack_trace" not in inspect.signature(DebugMode.__init__).parameters:
            return f"torch {torch.__version__}'s DebugMode has no record_stack_trace"
    return None


def debug_mode_available() -> bool:
    return debug_mode_missing("debugmode") is None


@dataclass
class Md5Limit:
    """Milliseconds to copy ``nbytes`` into host memory and MD5 them on all cores."""

    nbytes: int
    workers: int
    copy_ms: float  # the copy alone (device to pinned host memory; on the CPU, host to host)
    hash_ms: float  # MD5 alone, split evenly over the cores
    both_ms: float  # the copy and MD5 of every chunk, chunks spread over a thread pool: the limit


def copy_md5_limit(total_bytes: int, device: torch.device, chunk: int = 64 << 20) -> Md5Limit:
    """The copy + MD5 limit of ``total_bytes``: a thread pool of one worker per core, each
    copying its share of the bytes into its own host buffer chunk by chunk (from the device on
    CUDA, on its own stream) and MD5-ing each chunk (hashlib and torch's copy release the GIL).
    Also the copy alone and MD5 alone, for comparison. The source is one reused buffer of at
    most 256 MiB, as if no tensor were larger than a worker's share."""
    workers = os.cpu_count() or 1
    chunk = max(1, min(chunk, -(-total_bytes // workers)))
    n_chunks = -(-total_bytes // chunk)
    src = torch.randint(0, 255, (min(4 * chunk, total_bytes, 256 << 20) // chunk * chunk or chunk,),
                        dtype=torch.uint8, device=device)
    cuda = device.type == "cuda"
    bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=cuda) for _ in range(workers)]
    streams = [torch.cuda.Stream(device) for _ in range(workers)] if cuda else [None] * workers
    per_src = src.numel() // chunk

    def sizes(w: int) -> Iterator[tuple[int, int]]:
        for i in range(w, n_chunks, workers):  # (offset in the source, bytes)
            yield (i % per_src) * chunk, min(chunk, total_bytes - i * chunk)

    def copy(w: int, off: int, n: int) -> None:
        if cuda:
            with torch.cuda.stream(streams[w]):
                bufs[w][:n].copy_(src[off:off + n], non_blocking=True)
            streams[w].synchronize()
        else:
            bufs[w][:n].copy_(src[off:off + n])

    def work(w: int, do_copy: bool, do_hash: bool) -> None:
        h = hashlib.md5()
        view = memoryview(bufs[w].numpy())
        for off, n in sizes(w):
            if do_copy:
                copy(w, off, n)
            if do_hash:
                h.update(view[:n])
        h.hexdigest()

    def timed(do_copy: bool, do_hash: bool) -> float:
        if cuda:
            torch.cuda.synchronize()
        with ThreadPoolExecutor(workers) as pool:
            t0 = time.perf_counter()
            list(pool.map(lambda w: work(w, do_copy, do_hash), range(workers)))
            return (time.perf_counter() - t0) * 1000.0

    if cuda:
        torch.cuda.synchronize()  # the source is written on the current stream, read on the workers'
    for w in range(workers):  # first touch of the buffers, outside the timings
        copy(w, 0, chunk)
    copy_ms, hash_ms, both_ms = timed(True, False), timed(False, True), timed(True, True)
    return Md5Limit(total_bytes, workers, copy_ms, hash_ms, both_ms)


@contextlib.contextmanager
def _quiet() -> Iterator[TextIO]:
    """Silence the tools' own chatter while timing, outside the timed region.

    detect_anomaly warns on every entry (about its own cost, which is measured here), and the
    profiler's Kineto back end prints two lines per profiled step on file descriptor 2. Yields
    the real stderr, for progress lines.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    real = os.fdopen(os.dup(saved), "w", buffering=1)
    try:
        os.dup2(devnull, 2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield real
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
        real.close()


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@dataclass
class Timings:
    times: dict[str, list[float]]
    body: dict[str, list[float]]
    traces: dict[str, Any] = field(default_factory=dict)

    def median(self, key: str) -> float:
        return statistics.median(self.times[key])


def measure(w: Workload, keys: list[str], available: dict[str, tuple[str, Factory]], warmup: int,
            repeats: int, label: str = "") -> Timings:
    """Every configuration of ``keys`` once per round, in an order rotated every round; the last
    Trace of each kept."""
    tm = Timings({k: [] for k in keys}, {k: [] for k in keys})
    with _quiet() as progress:
        for rnd in range(warmup + repeats):
            t0 = time.perf_counter()
            # Rotate the order every round, and collect garbage before each step, outside the timed
            # region: the collections that the kept traces (one per configuration) make due
            # otherwise landed on whichever configuration allocated when they fell due, the same
            # one every round (on the H200, ResNet-50: check_numerics' steps, 13.6 ms of middle-
            # and full-generation collections a step, once a 280 ms full one; in a clean process
            # its exit took 8 ms). Each step still pays the collections its own allocations cause.
            at = rnd % len(keys)
            for k in keys[at:] + keys[:at]:
                gc.collect()
                ms, body_ms, value = time_step(w, available[k][1])
                if isinstance(value, tracer.Trace):
                    tm.traces[k] = value
                if rnd >= warmup:
                    tm.times[k].append(ms)
                    tm.body[k].append(body_ms)
            if rnd == warmup - 1:
                # Timed rounds measure the steady state: the batched kernels compiled (the first
                # traced step of a process, compilation included, has its own table).
                WARMUP.wait_all()
            what = "warm-up" if rnd < warmup else "timed"
            print(f"{label}round {rnd + 1}/{warmup + repeats} ({what}) done in {time.perf_counter() - t0:.1f} s",
                  file=progress)
    return tm


# ----------------------------------------------------------------------------------------------
# The first traced step of a fresh process


def _workload_argv(args: argparse.Namespace, model: str) -> list[str]:
    argv = ["--model", model, "--device", args.device]
    for opt in ("batch", "seq", "threads", "autocast"):
        value = getattr(args, opt)
        if value is not None:
            argv += [f"--{opt}", str(value)]
    if args.foreach:
        argv.append("--foreach")
    if args.clock != "wall":  # the first traced step on the same clock as the table's
        argv += ["--clock", args.clock]
    return argv


def first_step_child(args: argparse.Namespace, w: Workload) -> int:
    """In a fresh process: two plain steps (torch's own first-call costs), then the first
    traced step of the process and ``args.later`` more; one JSON line with the times."""
    key = args.first_step_child
    make = configurations(w.device)[key][1]
    with _quiet():
        for _ in range(2):
            time_step(w, contextlib.nullcontext)
        first, _, _ = time_step(w, make)
        later = [time_step(w, make)[0] for _ in range(args.later)]
    print("FIRST_STEP " + json.dumps({"key": key, "first_ms": first, "later_ms": later}))
    return 0


@dataclass
class FirstStep:
    key: str
    first_ms: float | None = None
    later_ms: float | None = None  # median of the later traced steps
    error: str | None = None


def first_traced_step(args: argparse.Namespace, model: str, key: str) -> FirstStep:
    """Run ``first_step_child`` in a new interpreter; its first traced step is the process's."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(tracer.__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cold = tempfile.mkdtemp(prefix="gradtrace-bench-cache-") if args.cold_cache else None
    if cold is not None:  # no compiled kernels from earlier runs
        env["TRITON_CACHE_DIR"] = os.path.join(cold, "triton")
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cold, "inductor")
    cmd = [sys.executable, os.path.abspath(__file__), *_workload_argv(args, model),
           "--first-step-child", key, "--later", str(args.first_step_later)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.first_step_timeout)
    except subprocess.TimeoutExpired:
        return FirstStep(key, error=f"timed out after {args.first_step_timeout} s")
    finally:
        if cold is not None:
            import shutil

            shutil.rmtree(cold, ignore_errors=True)
    for line in proc.stdout.splitlines():
        if line.startswith("FIRST_STEP "):
            data = json.loads(line.split(" ", 1)[1])
            return FirstStep(key, data["first_ms"], statistics.median(data["later_ms"]))
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return FirstStep(key, error=f"exit {proc.returncode}: {' / '.join(tail)}")


# ----------------------------------------------------------------------------------------------
# Tables


def main_table(keys: list[str], available: dict[str, tuple[str, Factory]], tm: Timings,
               calls: int) -> list[str]:
    """The table of every row; the ``recorder share`` column when the floor row it needs ran."""
    base = tm.median("plain")
    shares = any(kind(k) == GRADTRACE and share_floor(k) in keys for k in keys)
    width = max(len(available[k][0]) for k in keys)
    share_head, share_rule = (" recorder share |", "---------------:|") if shares else ("", "")
    lines = [f"| {'configuration':<{width}} | median ms | ratio |{share_head} µs/call | body ms |",
             f"|{'-' * (width + 2)}|----------:|------:|{share_rule}--------:|--------:|"]
    for k in keys:
        med = tm.median(k)
        per_call = "" if k == "plain" or not calls else f"{(med - base) * 1000.0 / calls:.1f}"
        share = ""
        if shares:
            floor = share_floor(k)
            share = f" {(med - tm.median(floor)) / base:+14.2f} |" if kind(k) == GRADTRACE and floor in keys \
                else f" {'':>14} |"
        body = statistics.median(tm.body[k])
        lines.append(f"| {available[k][0]:<{width}} | {med:9.2f} | {med / base:5.2f} |{share} "
                     f"{per_call:>7} | {body:7.2f} |")
    return lines


def first_step_table(rows: list[FirstStep], available: dict[str, tuple[str, Factory]], later: int,
                     cold: bool) -> list[str]:
    cache = "empty kernel caches" if cold else "the kernel caches as they are"
    lines = [f"First traced step of a fresh process (after 2 plain steps; {cache}) against the median of the "
             f"{later} traced steps after it:", "",
             "| first traced step | first ms | later ms | first/later |", "|---|---:|---:|---:|"]
    for r in rows:
        label = available[r.key][0]
        if r.error is not None:
            lines.append(f"| {label} | failed: {r.error} | | |")
        else:
            assert r.first_ms is not None and r.later_ms is not None
            lines.append(f"| {label} | {r.first_ms:.2f} | {r.later_ms:.2f} | {r.first_ms / r.later_ms:.2f} |")
    return lines


def md5_lines(tm: Timings, limit: Md5Limit) -> list[str]:
    base, md5 = tm.median("plain"), tm.median("md5")
    return [f"Copy + MD5 limit for {limit.nbytes / 2**20:.1f} MiB (the tensor values one traced step records): "
            f"copy alone {limit.copy_ms:.1f} ms, MD5 alone on {limit.workers} cores {limit.hash_ms:.1f} ms, "
            f"both in a thread pool of {limit.workers} **{limit.both_ms:.1f} ms**. "
            f"trace(hash=\"md5\") takes {md5:.1f} ms = {md5 / limit.both_ms:.2f}x the limit; it adds "
            f"{md5 - base:.1f} ms to the plain step = **{(md5 - base) / limit.both_ms:.2f}x the limit**."]


def per_object_lines(tm: Timings, available: dict[str, tuple[str, Factory]], keys: list[str]) -> list[str]:
    """µs of recorder time per recorded object, for the rows of ``keys`` that ran and traced."""
    base = tm.median("plain")
    lines = ["Recorder time per recorded object: (traced step - plain step) / (calls + grad nodes + tensor "
             "values one traced step records):", "",
             "| configuration | added ms | calls + grad nodes + tensor values | µs per object |",
             "|---|---:|---:|---:|"]
    for k in keys:
        t = tm.traces.get(k)
        if t is None:
            continue
        added = tm.median(k) - base
        lines.append(f"| {available[k][0]} | {added:.2f} | {len(t.calls)} + {len(t.grad_nodes)} + "
                     f"{len(t.tensors)} = {recorded_objects(t)} | {added * 1000.0 / recorded_objects(t):.1f} |")
    if len(lines) == 4:
        return []
    # The floor rows record nothing: their time per object of the first traced row above is what
    # the hook points alone cost, below which no recorder through them can go.
    reference = next(tm.traces[k] for k in keys if k in tm.traces)
    for k in FLOOR_KEYS:
        if tm.times.get(k):
            added = tm.median(k) - base
            lines.append(f"| {available[k][0]} (records nothing) | {added:.2f} | {recorded_objects(reference)} "
                         f"(as above) | {added * 1000.0 / recorded_objects(reference):.1f} |")
    return lines


def minimal_records_lines(tm: Any, available: dict[str, tuple[str, Factory]], lean: Any) -> list[str]:
    """What the ``floor-records`` row says of the recorder share's bound: its µs per object above
    the node walk, and what gradtrace's lean trace's objects would cost at that rate."""
    if not (tm.times.get(RECORDS_FLOOR) and tm.times.get(LEAN_FLOOR)) or lean is None:
        return []
    from floor import minimal_records_objects  # a sibling script (see _floor_rows)

    n_min = minimal_records_objects()
    if not n_min:
        return []
    base = tm.median("plain")
    per = (tm.median(RECORDS_FLOOR) - tm.median(LEAN_FLOOR)) / n_min
    n = recorded_objects(lean)
    return [f"{available[RECORDS_FLOOR][0]}: {n_min} objects a step (every call inside the optimizer step "
            f"is one here), {per * 1000.0:.2f} µs each above the node walk. At that rate the {n} objects of "
            f"gradtrace's lean trace cost {per * n:.1f} ms = a recorder share of +{per * n / base:.2f} with "
            "nothing but one record per object kept."]


def header_lines(args: argparse.Namespace, device: torch.device) -> list[str]:
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    import transformers

    return [f"torch {torch.__version__}, transformers {transformers.__version__}, python "
            f"{platform.python_version()}, gradtrace {tracer.__version__}; device {args.device} ({dev_name}), "
            f"{torch.get_num_threads()} torch CPU threads, {os.cpu_count()} cores"
            + ("; times are this process's CPU time (--clock process)" if args.clock == "process" else "")]


def workload_report(args: argparse.Namespace, model: str, keys: list[str], notes: list[str],
                    warmup: int, repeats: int, first_step: bool, label: str = "") -> list[str]:
    """Build ``model``, time ``keys`` on it and return its report's lines (also printed)."""
    device = torch.device(args.device)
    autocast_name = args.autocast or ("bf16" if device.type == "cuda" else "none")
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16, "none": None}[autocast_name]
    w = build(model, device, args.batch, args.seq, autocast, True if args.foreach else None)
    available = configurations(device)
    tm = measure(w, keys, available, warmup, repeats, label)

    # What one traced step records (the denominator of µs/call), from the last traced round: the
    # first optimizer step also creates AdamW's state, so it makes more calls than the others.
    t = tm.traces.get("md5") or tm.traces.get("stacks") or next(iter(tm.traces.values()), None)
    if t is None:
        with tracer.trace(hash="none", stacks=False) as t:
            w.step()
    nbytes = recorded_bytes(t)
    n_params = sum(q.numel() for q in w.model.parameters())
    lines = [f"model {model}: {n_params / 1e6:.1f}M parameters, {w.describe()}; step = zero_grad + forward + "
             f"backward + AdamW ({'foreach' if args.foreach or device.type == 'cuda' else 'per-parameter'}); "
             f"autocast {autocast_name}",
             f"per traced step: {len(t.calls)} calls, {len(t.grad_nodes)} grad nodes, {len(t.tensors)} tensor "
             f"values, {nbytes / 2**20:.1f} MiB",
             f"{warmup} warm-up rounds, median of {repeats} timed rounds", ""]
    lines += main_table(keys, available, tm, len(t.calls))
    extra: list[list[str]] = []
    if LEAN_FLOOR in keys or SHARE_FLOOR in keys:
        extra.append(["recorder share: a gradtrace row's ratio minus the ratio of the floor row of the hook "
                      f"points it uses: \"{available[LEAN_FLOOR][0]}\" for the rows without checksums or stats "
                      f"(no built-in grad node is hooked: node_runs), \"{available[SHARE_FLOOR][0]}\" for the "
                      "others (the share then includes their checksums or stats)."])
    extra.append(minimal_records_lines(tm, available, tm.traces.get("stacks") or tm.traces.get("nostacks")))
    md5_bytes = recorded_bytes(tm.traces["md5"]) if "md5" in tm.traces else 0
    if md5_bytes:
        extra.append(md5_lines(tm, copy_md5_limit(md5_bytes, device)))
    if device.type == "cpu":
        extra.append(per_object_lines(tm, available, [k for k in ("stacks", "fast") if k in keys]))
    extra += [[n] for n in notes]
    for e in extra:
        if e:
            lines += ["", *e]
    del tm, t, w
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if first_step:
        rows = []
        with _quiet() as progress:
            for key in FIRST_STEP_CONFIGS.split(","):
                print(f"{label}first traced step, {available[key][0]}: a fresh process", file=progress)
                rows.append(first_traced_step(args, model, key))
        lines += ["", *first_step_table(rows, available, args.first_step_later, args.cold_cache)]
    return lines


def _emit(lines: list[str], out: list[str]) -> None:
    for line in lines:
        print(line)
    sys.stdout.flush()
    out += lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Overhead of gradtrace and of PyTorch's own tools on a training step.")
    p.add_argument("--model", choices=MODELS, default="tiny")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--suite", action="store_true",
                   help="every workload of --suite-models, one table each, with the floor rows, the peers, the "
                        "first traced step and the copy + MD5 limit")
    p.add_argument("--suite-models", default=None,
                   help=f"comma-separated models of --suite (default {SUITE_MODELS['cuda']} on cuda, "
                        f"{SUITE_MODELS['cpu']} on cpu)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed rounds (default 3 for small models, 1 for the full-size ones and in --suite)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed rounds (default 15 for small models, 3 for the full-size ones and in --suite)")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None, help="sequence length; the image side for the ResNets")
    p.add_argument("--configs", default=None,
                   help=f"comma-separated rows to time, from {','.join(configurations(torch.device('cpu')))} "
                        f"(default {DEFAULT_CONFIGS}; with --suite {SUITE_CONFIGS})")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (default: torch's; 1 in a CPU --suite)")
    p.add_argument("--foreach", action="store_true",
                   help="multi-tensor AdamW on the CPU too (the CUDA default), so a CPU run makes the same calls")
    p.add_argument("--autocast", choices=("bf16", "fp16", "none"), default=None,
                   help="autocast dtype of the forward (default: bf16 on cuda, none on cpu)")
    p.add_argument("--first-step", action=argparse.BooleanOptionalAction, default=None,
                   help="time the first traced step of a fresh process (default: on with --suite)")
    p.add_argument("--first-step-later", type=int, default=3, help="later traced steps the first is compared with")
    p.add_argument("--first-step-timeout", type=int, default=900, help="seconds per first-step subprocess")
    p.add_argument("--cold-cache", action="store_true",
                   help="first-step subprocesses start with empty Triton/Inductor caches")
    p.add_argument("--out", default=None, help="also write the report (markdown) to this file")
    p.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                   help="wall time (default), or this process's CPU time (CPU only: steadier A/B on a shared host)")
    p.add_argument("--first-step-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--later", type=int, default=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.clock != "wall" and args.device != "cpu":
        p.error("--clock process measures CPU time: a GPU step's time is not in it")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device available")
    device = torch.device(args.device)
    use_clock(args.clock)
    if args.threads is None and (args.suite or args.clock == "process") and device.type == "cpu":
        # Steadier timings on a small shared machine (the MD5 limit still uses every core); on
        # the process clock, also no CPU time of idle worker threads spinning between ops.
        args.threads = 1
    if args.threads:
        torch.set_num_threads(args.threads)

    if args.first_step_child is not None:
        autocast_name = args.autocast or ("bf16" if device.type == "cuda" else "none")
        autocast = {"bf16": torch.bfloat16, "fp16": torch.float16, "none": None}[autocast_name]
        w = build(args.model, device, args.batch, args.seq, autocast, True if args.foreach else None)
        return first_step_child(args, w)

    available = configurations(device)
    keys = [k.strip() for k in (args.configs or (SUITE_CONFIGS if args.suite else DEFAULT_CONFIGS)).split(",")
            if k.strip()]
    unknown = [k for k in keys if k not in available]
    if unknown or not keys:
        p.error(f"--configs: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(available)}")
    notes = []
    for k in [k for k in keys if k.startswith("debugmode")]:
        why = debug_mode_missing(k)
        if why is not None:
            notes.append(f"{available[k][0]}: row skipped ({why}).")
            print(notes[-1], file=sys.stderr)
            keys.remove(k)
    if "plain" not in keys:
        keys.insert(0, "plain")  # every ratio is to the plain step
    if args.suite:
        models = [m.strip() for m in (args.suite_models or SUITE_MODELS[device.type]).split(",") if m.strip()]
        bad = [m for m in models if m not in MODELS]
        if bad:
            p.error(f"--suite-models: unknown {', '.join(bad)}; choose from {', '.join(MODELS)}")
    else:
        models = [args.model]
    first_step = args.first_step if args.first_step is not None else args.suite

    out: list[str] = []
    _emit(header_lines(args, device), out)
    for i, model in enumerate(models):
        large = args.suite or model in LARGE_MODELS
        warmup = args.warmup if args.warmup is not None else (1 if large else 3)
        repeats = args.repeats or (3 if large else 15)
        label = f"[{model} {i + 1}/{len(models)}] " if args.suite else ""
        lines = workload_report(args, model, keys, notes, warmup, repeats, first_step, label)
        lines = ["", f"### {model}", "", *lines] if args.suite else ["", *lines]
        _emit(lines, out)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write("\n".join(out).lstrip("\n") + "\n")
        print(f"\nwritten to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
