"""What tracing costs: one training step under each tool, as a ratio to the plain step.

Every configuration runs the same model and the same step (zero_grad, forward, backward,
AdamW step) in the same process; the configurations take turns within every repeat, so drift
of the machine (clock, caches, other load) falls on all of them alike. Each timed step includes
entering and leaving the tool's context manager, i.e. the trace's finalisation (waiting for its
checksums) and the profiler's event processing.

    python benchmarks/overhead.py                          # tiny GPT-2 on the CPU
    python benchmarks/overhead.py --model gpt2-small       # the real 124M config, random init
    python benchmarks/overhead.py --device cuda --repeats 20

``µs/call`` is the time added to the step divided by the number of API calls the trace records
in one step (the same count for every row, so the rows compare). ``body ms`` is the time until
the step's own code returned, before the tool's exit and the final synchronisation: on a GPU,
the CPU time spent issuing the step. While it stays below the GPU's time, the CPU work a tool
adds is hidden behind the GPU's; above it, every added microsecond shows.

On CUDA the forward runs under bf16 autocast by default (``--autocast``), as real training does.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TextIO

import torch

import tracer


@dataclass
class Workload:
    model: torch.nn.Module
    ids: torch.Tensor
    opt: torch.optim.Optimizer
    device: torch.device
    autocast: torch.dtype | None = None

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None):
            loss = self.model(input_ids=self.ids, labels=self.ids).loss
        loss.backward()
        self.opt.step()


def build(model: str, device: torch.device, batch: int | None, seq: int | None,
          autocast: torch.dtype | None = None, foreach: bool | None = None) -> Workload:
    from transformers import GPT2Config, GPT2LMHeadModel

    if model in ("tiny", "tiny12"):
        # tiny12: GPT-2 small's 12 layers at a tiny width, so the step makes the same calls, grad
        # nodes and tensors as gpt2-small while the ops cost little: the recorder's cost shows.
        config = GPT2Config(n_layer=2 if model == "tiny" else 12, n_embd=64, n_head=2, vocab_size=256,
                            n_positions=64, bos_token_id=0, eos_token_id=0)
        batch, seq = batch or 4, seq or 64
    else:  # gpt2-small: the released 124M architecture with random weights (nothing is downloaded)
        config = GPT2Config()
        # A short sequence on the CPU keeps one step around a second; the GPU takes the real length.
        batch = batch or (1 if device.type == "cpu" else 8)
        seq = seq or (64 if device.type == "cpu" else 1024)
    torch.manual_seed(0)
    m = GPT2LMHeadModel(config).to(device).train()
    m.loss_type = "ForCausalLM"  # the default, named to avoid transformers' warning
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    # foreach=None is torch's default: the multi-tensor AdamW on CUDA, the per-parameter one on CPU.
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=foreach)
    return Workload(m, ids, opt, device, autocast)


def default_workload(device_name: str, model: str | None) -> tuple[str, Workload]:
    """The benchmark step of ``phases.py`` and ``floor.py`` and its model's name: tiny12 on one
    CPU thread, GPT-2 small under bf16 autocast on CUDA, foreach AdamW, unless ``model`` names
    another."""
    device = torch.device(device_name)
    if device.type == "cpu":
        torch.set_num_threads(1)
    name = model or ("gpt2-small" if device.type == "cuda" else "tiny12")
    return name, build(name, device, None, None, torch.bfloat16 if device.type == "cuda" else None, foreach=True)


Factory = Callable[[], contextlib.AbstractContextManager[Any]]


def configurations(device: torch.device) -> dict[str, tuple[str, Factory]]:
    """key -> (row label, context manager factory), in table order (``--configs`` picks rows).

    ``fast`` is the on-device fingerprint instead of MD5; ``stats``/``md5-nostats`` split the
    md5 row's cost into the per-tensor stats and the checksums themselves.
    """
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return {
        "plain": ("plain", contextlib.nullcontext),
        "nostacks": ('trace(hash="none", stacks=False)', lambda: tracer.trace(hash="none", stacks=False)),
        "stacks": ('trace(hash="none", stacks=True)', lambda: tracer.trace(hash="none", stacks=True)),
        "md5": ('trace(hash="md5")', lambda: tracer.trace(hash="md5")),
        "fast": ('trace(hash="fast")', lambda: tracer.trace(hash="fast")),
        "anomaly": ("detect_anomaly(check_nan=True)", lambda: torch.autograd.detect_anomaly(check_nan=True)),
        "profiler": ("profiler(record_shapes, with_stack)", lambda: torch.profiler.profile(
            activities=activities, record_shapes=True, with_stack=True)),
        "stats": ('trace(hash="none", stats=True)', lambda: tracer.trace(hash="none", stats=True)),
        "numerics": ('trace(hash="none", check_numerics=True)',
                     lambda: tracer.trace(hash="none", check_numerics=True)),
        "debugmode": ('DebugMode + log_tensor_hashes (private)', _debug_mode_with_hashes),
        "md5-nostats": ('trace(hash="md5", stats=False)', lambda: tracer.trace(hash="md5", stats=False)),
        # Every op inside optimizer.step() recorded, as before the step became one call.
        "stacks-ops": ('trace(hash="none", optimizer_ops=True)',
                       lambda: tracer.trace(hash="none", optimizer_ops=True)),
        "fast-ops": ('trace(hash="fast", optimizer_ops=True)', lambda: tracer.trace(hash="fast", optimizer_ops=True)),
    }


DEFAULT_CONFIGS = "plain,nostacks,stacks,md5,fast,numerics,anomaly,profiler,debugmode"


@contextlib.contextmanager
def _debug_mode_with_hashes() -> Iterator[None]:
    """PyTorch's own DebugMode hashing every op output (private API: skipped where absent)."""
    from torch.utils._debug_mode import DebugMode

    with DebugMode(), DebugMode.log_tensor_hashes(hash_fn="norm"):
        yield


def debug_mode_available() -> bool:
    try:
        from torch.utils._debug_mode import DebugMode

        return hasattr(DebugMode, "log_tensor_hashes")
    except ImportError:
        return False


def md5_machine_limit(total_bytes: int, device: torch.device, chunk: int = 256 << 20) -> tuple[float, float]:
    """Seconds to (copy ``total_bytes`` from the device to pinned host memory, MD5 them on all
    cores): each measured on its own at full speed. A pipeline overlaps the two, so the larger
    is the floor for exact MD5 of a step's tensors on this machine. The hashing is split evenly
    over the cores, as if no tensor were larger than a core's share."""
    import hashlib
    from concurrent.futures import ThreadPoolExecutor

    workers = os.cpu_count() or 1
    copy_s = 0.0
    if device.type == "cuda":
        src = torch.randint(0, 255, (min(chunk, total_bytes),), dtype=torch.uint8, device=device)
        bufs = [torch.empty(src.numel(), dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        done, i = 0, 0
        while done < total_bytes:
            n = min(src.numel(), total_bytes - done)
            bufs[i % 2][:n].copy_(src[:n], non_blocking=True)
            done += n
            i += 1
        torch.cuda.synchronize()
        copy_s = time.perf_counter() - t0
    share = -(-total_bytes // workers)
    piece = min(share, 64 << 20)
    host = torch.randint(0, 255, (piece * workers,), dtype=torch.uint8)
    view = memoryview(host.numpy())

    def hash_share(w: int) -> None:
        h = hashlib.md5()
        mine = view[w * piece:(w + 1) * piece]
        left = share
        while left > 0:
            h.update(mine[:min(piece, left)])
            left -= piece
        h.hexdigest()

    with ThreadPoolExecutor(workers) as pool:
        t0 = time.perf_counter()
        list(pool.map(hash_share, range(workers)))
        hash_s = time.perf_counter() - t0
    return copy_s, hash_s


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


def time_step(w: Workload, make_ctx: Factory) -> tuple[float, float, Any]:
    """Milliseconds of one step under the context manager, milliseconds until the step's Python
    code returned (before the manager's exit and the final sync: on a GPU, the time the CPU
    spent issuing work), and what the manager gave (a Trace)."""
    sync = torch.cuda.synchronize if w.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with make_ctx() as value:
        w.step()
        t1 = time.perf_counter()
    sync()
    return (time.perf_counter() - t0) * 1000.0, (t1 - t0) * 1000.0, value


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Overhead of gradtrace and of PyTorch's own tools on a training step.")
    p.add_argument("--model", choices=("tiny", "tiny12", "gpt2-small"), default="tiny")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--warmup", type=int, default=None, help="untimed rounds (default 3 tiny, 1 gpt2-small)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 15 tiny, 3 gpt2-small)")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help=f"comma-separated rows to time, from {','.join(configurations(torch.device('cpu')))} "
                        f"(default {DEFAULT_CONFIGS})")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--foreach", action="store_true",
                   help="multi-tensor AdamW on the CPU too (the CUDA default), so a CPU run makes the same calls")
    p.add_argument("--autocast", choices=("bf16", "fp16", "none"), default=None,
                   help="autocast dtype of the forward (default: bf16 on cuda, none on cpu)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device available")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    available = configurations(device)
    keys = [k.strip() for k in args.configs.split(",") if k.strip()]
    if "debugmode" in keys and not debug_mode_available():
        print("DebugMode with tensor hashes: not in this torch, row skipped", file=sys.stderr)
        keys.remove("debugmode")
    unknown = [k for k in keys if k not in available]
    if unknown or not keys:
        p.error(f"--configs: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(available)}")
    if "plain" not in keys:
        keys.insert(0, "plain")  # every ratio is to the plain step
    small = args.model != "gpt2-small"
    warmup = args.warmup if args.warmup is not None else (3 if small else 1)
    repeats = args.repeats or (15 if small else 3)
    autocast_name = args.autocast or ("bf16" if device.type == "cuda" else "none")
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16, "none": None}[autocast_name]
    w = build(args.model, device, args.batch, args.seq, autocast, True if args.foreach else None)

    times: dict[str, list[float]] = {k: [] for k in keys}
    issue: dict[str, list[float]] = {k: [] for k in keys}
    traces: dict[str, Any] = {}
    with _quiet() as progress:
        for rnd in range(warmup + repeats):
            for k in keys:
                ms, issue_ms, value = time_step(w, available[k][1])
                if isinstance(value, tracer.Trace):
                    traces[k] = value
                if rnd >= warmup:
                    times[k].append(ms)
                    issue[k].append(issue_ms)
            what = "warm-up" if rnd < warmup else "timed"
            print(f"round {rnd + 1}/{warmup + repeats} ({what}) done", file=progress)

    # What one traced step records (the denominator of µs/call), from the last traced round: the
    # first optimizer step also creates AdamW's state, so it makes more calls than the others.
    t = traces.get("md5") or next(iter(traces.values()), None)
    if t is None:
        with tracer.trace(hash="none", stacks=False) as t:
            w.step()
    calls = len(t.calls)
    hashed = sum(r.numel * torch.empty((), dtype=getattr(torch, r.dtype)).element_size()
                 for r in t.tensors.values() if r.md5 is not None)

    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    n_params = sum(q.numel() for q in w.model.parameters())
    print(f"torch {torch.__version__}, python {platform.python_version()}, device {args.device} ({dev_name}), "
          f"{torch.get_num_threads()} CPU threads")
    print(f"model {args.model}: {n_params / 1e6:.1f}M parameters, batch {w.ids.shape[0]} x seq {w.ids.shape[1]}; "
          f"step = zero_grad + forward + backward + AdamW; autocast {autocast_name}")
    hashed_text = f", {hashed / 2**20:.1f} MiB hashed by md5" if t.hash_algorithm == "md5" else ""
    print(f"per traced step: {calls} calls, {len(t.grad_nodes)} grad nodes, {len(t.tensors)} tensors{hashed_text}")
    print(f"{warmup} warm-up rounds, median of {repeats} timed rounds\n")
    base = statistics.median(times["plain"])
    width = max(len(available[k][0]) for k in keys)
    limit_ms = copy_ms = hash_ms = None
    if "md5" in keys and hashed:
        copy_s, hash_s = md5_machine_limit(hashed, device)
        copy_ms, hash_ms = copy_s * 1000.0, hash_s * 1000.0
        limit_ms = max(copy_ms, hash_ms)
    print(f"| {'configuration':<{width}} | median ms | ratio | µs/call | body ms |")
    print(f"|{'-' * (width + 2)}|----------:|------:|--------:|--------:|")
    for k in keys:
        med = statistics.median(times[k])
        per_call = "" if k == "plain" else f"{(med - base) * 1000.0 / calls:.1f}"
        body = statistics.median(issue[k])
        print(f"| {available[k][0]:<{width}} | {med:9.2f} | {med / base:5.2f} | {per_call:>7} | {body:7.2f} |")
    if limit_ms is not None:
        md5_extra = statistics.median(times["md5"]) - base
        print(f"\nMD5 machine limit for {hashed / 2**20:.1f} MiB: copying it to pinned host memory takes "
              f"{copy_ms:.1f} ms, hashing it on {os.cpu_count()} cores {hash_ms:.1f} ms; overlapped, the floor is "
              f"{limit_ms:.1f} ms. trace(hash=\"md5\") adds {md5_extra:.1f} ms to the step = "
              f"{md5_extra / limit_ms:.2f}x the limit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
