"""Memory records: allocations and frees attributed to calls and grad nodes, peak, views, summary.

CPU tests run everywhere; the CUDA ones (marked ``cuda``) check the allocator-history path, the
summary against ``torch.cuda.memory_stats()`` and a GPT-2 step's attribution.
"""

from __future__ import annotations

import csv
import gc
import json
import os
import subprocess
import sys
import weakref

import pytest
import torch
import torch.nn as nn

import tracer
from tests.models import hf_model
from tracer.analysis.memory import MemoryRecord
from tracer.api import record_memory
from tracer.features.memory import MemoryListener, memory_summary

PLANTED = 1 << 20  # elements of the planted temporary: 4 MiB of float32


class Planter(nn.Module):
    """A layer that allocates a known large temporary and keeps it alive until its output is made."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tmp = torch.zeros(PLANTED)
        return self.lin(x) + tmp[:16].sum()


def planted_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), Planter(), nn.Linear(16, 4))


def live_storages(extra: list[torch.Tensor | None]) -> dict[int, int]:
    """id -> nbytes of every CPU storage Python can reach, plus those of ``extra``."""
    gc.collect()
    out: dict[int, int] = {}
    tensors = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)] + [t for t in extra if t is not None]
    for t in tensors:
        if t.device.type == "cpu" and t.layout == torch.strided:
            s = t.untyped_storage()
            out[id(s)] = s.nbytes()
    return out


# ---- CPU ---------------------------------------------------------------------------------------------
def test_planted_temporary_is_attributed_to_its_call_and_tops_the_peak():
    model = planted_model()
    x = torch.randn(5, 8)
    with record_memory() as rec:
        loss = model(x).pow(2).mean()
        loss.backward()
    t = rec.trace
    assert t is not None and rec.events == t.memory
    zeros = next(c for c in t.calls if c.api.endswith("zeros"))
    assert (zeros.name, zeros.module, zeros.outputs) == ("zeros0", "2", ["zeros0:out"])
    assert sum(e["bytes"] for e in rec.allocs if e["owner"] == "zeros0") == PLANTED * 4
    assert [e["tensor"] for e in rec.allocs if e["owner"] == "zeros0"] == ["zeros0:out"]
    # The temporary dies when Planter.forward returns, right after its last call (add0).
    free = next(e for e in rec.frees if e["tensor"] == "zeros0:out")
    assert (free["bytes"], free["owner"], free["after"], free["phase"]) == (PLANTED * 4, "add0", True, "forward")

    peak = rec.peak
    assert peak is not None and peak.device == "cpu" and peak.phase == "forward"
    assert (peak.tensors[0].name, peak.tensors[0].bytes, peak.tensors[0].producer) == ("zeros0:out", PLANTED * 4,
                                                                                         "zeros0")
    assert peak.allocated == sum(pt.bytes for pt in peak.tensors) and peak.untracked == 0

    # Saved activations are freed in backward, each by the grad node that used it last.
    node_names = {n.name for n in t.grad_nodes}
    back_frees = [e for e in rec.frees if e["phase"] == "backward"]
    assert back_frees and all(e["owner"] in node_names for e in back_frees)
    by_tensor = {e["tensor"]: e["owner"] for e in back_frees}
    assert by_tensor["linear0:out"] == "gelu0/GeluBackward0"      # GELU's saved input
    assert by_tensor["gelu0:out"] == "linear1/AddmmBackward0"     # the next Linear's saved input
    # Gradients are allocated by the nodes that compute them; the root gradient by backward0.
    grads = {e["tensor"]: e["owner"] for e in rec.allocs if e["phase"] == "backward"}
    assert grads["mean0:out@grad"] == "backward0"
    assert grads["linear0:out@grad"] == "gelu0/GeluBackward0"
    assert grads["0.bias@grad"] == "linear0/AddmmBackward0"


def test_allocs_minus_frees_equal_the_live_bytes_change_on_a_training_step():
    model, ids = hf_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    params = list(model.parameters())
    before = live_storages([p.grad for p in params])
    with tracer.trace(hash="none", memory=True) as t:
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    after = live_storages([p.grad for p in params] + state + [out.loss, out.logits])
    new_live = sum(n for k, n in after.items() if k not in before)
    rec = MemoryRecord.from_trace(t)
    assert rec.net("cpu") == new_live > 0
    assert rec.marker("end", "cpu")["allocated_after"] == new_live
    # allocated_after is the running sum of the events.
    running = 0
    for e in rec.events:
        if e["action"] in ("alloc", "free"):
            running += e["bytes"] if e["action"] == "alloc" else -e["bytes"]
            assert e["allocated_after"] == running
    # Every free pairs with an earlier alloc of the same storage and size.
    live: dict[int, int] = {}
    for e in rec.events:
        if e["action"] == "alloc":
            live[e["addr"]] = e["bytes"]
        elif e["action"] == "free":
            assert live.pop(e["addr"]) == e["bytes"]
    assert rec.attributed_fraction() == 1.0
    assert {e["phase"] for e in rec.allocs} == {"forward", "backward", "optimizer"}
    # AdamW's state is made inside the optimizer step, recorded as one call (AdamW0), and its
    # allocations are that call's, under the state's names.
    made = [e["tensor"] for e in rec.allocs if e["owner"] == "AdamW0"]
    assert sorted(made) == sorted(f"{n}.{k}" for n, _ in model.named_parameters()
                                  for k in ("exp_avg", "exp_avg_sq", "step"))


def test_custom_function_and_metadata_queries_keep_attribution():
    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            tmp = x * 2
            n = tmp.size(0)  # a metadata query: announced to listeners, never finished
            del tmp          # freed inside the Function, after the query
            return x + n

        @staticmethod
        def backward(ctx, g):
            return g * 1.0

    x = torch.randn(64, requires_grad=True)
    with record_memory() as rec:
        y = Scale.apply(x)
        y.sum().backward()
    t = rec.trace
    assert [c.name for c in t.calls][:3] == ["Scale0", "mul0", "add0"]
    tmp_free = next(e for e in rec.frees if e["tensor"] == "mul0:out")
    assert (tmp_free["owner"], tmp_free["after"]) == ("Scale0", False)
    assert next(e for e in rec.allocs if e["tensor"] == "mul0:out")["owner"] == "mul0"
    assert next(e for e in rec.allocs if e["tensor"] == "add0:out")["owner"] == "add0"
    # The gradient is made by the op inside Scale's backward(), a call nested under its node.
    assert t["mul1"].parent == "Scale0/ScaleBackward" and t["mul1"].phase == "backward"
    assert next(e for e in rec.allocs if e["tensor"] == "mul1:out")["owner"] == "mul1"
    assert t["input0@grad"].producer == "Scale0/ScaleBackward"


def test_views_and_in_place_changes_allocate_nothing():
    base = torch.randn(32, 32)
    with record_memory() as rec:
        a = base * 1            # 4 KiB
        v = a.view(-1)[:100]    # views of a
        a.add_(1)               # in place
        d = a.detach()          # alias
        e = torch.einsum("ij->ji", a).contiguous()  # a new storage (einsum + contiguous copy)
        s = a.split(8)          # views
    assert [(x["owner"], x["bytes"]) for x in rec.allocs] == [("mul0", 4096), ("contiguous0", 4096)]
    del v, d, e, s


def test_record_keeps_no_tensor_alive_and_stops_at_the_end():
    with record_memory() as rec:
        y = torch.ones(1000) * 2
    ref = weakref.ref(y)
    n = len(rec.events)
    del y
    gc.collect()
    assert ref() is None
    assert len(rec.events) == n  # frees after the block are not part of the record
    # The CPU's end marker (a process that used CUDA before also gets one per CUDA device).
    cpu_end = [e for e in rec.events if e["action"] == "end" and e["device"] == "cpu"]
    assert [e["allocated_after"] for e in cpu_end] == [4000]


def test_save_load_csv_table_and_cli(tmp_trace, tmp_path, capsys, monkeypatch):
    from export.cli import main

    model = planted_model()
    with tracer.trace(hash="none", memory=True) as t:
        model(torch.randn(5, 8)).sum().backward()
    t.save(tmp_trace)
    loaded = tracer.load(tmp_trace)
    assert loaded.memory == t.memory
    rec = MemoryRecord.from_trace(loaded)
    assert rec.peak is not None and rec.peak.tensors[0].name == "zeros0:out"

    path = os.fspath(tmp_path / "mem.csv")
    rec.to_csv(path)
    with open(path, newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == len(rec.events)
    planted = next(r for r in rows if r["tensor"] == "zeros0:out" and r["action"] == "alloc")
    assert (planted["bytes"], planted["owner"], planted["module"], planted["kind"]) == (str(PLANTED * 4), "zeros0",
                                                                                         "2", "call")
    assert planted["line"] == f"test_memory.py:{Planter.forward.__code__.co_firstlineno + 1}"

    text = str(rec.table())
    for needle in ("Top allocators by bytes", "Per module", "By phase", "Peak on cpu", "zeros0:out"):
        assert needle in text

    csv2 = os.fspath(tmp_path / "cli.csv")
    assert main(["memory", tmp_trace, "--top", "5", "--csv", csv2]) == 0
    out = capsys.readouterr().out
    assert "zeros0" in out and "Peak on cpu" in out and os.path.exists(csv2)

    with tracer.trace(hash="none") as plain:
        torch.ones(3) * 2
    bare = os.fspath(tmp_path / "bare.gtrace")
    plain.save(bare)
    assert main(["memory", bare]) == 2
    assert "has no memory records" in capsys.readouterr().err


def test_timeline_data_marks_peak_and_backward():
    from tracer.analysis.memory import memory_timeline_data

    model = planted_model()
    with tracer.trace(hash="none", memory=True) as t:
        model(torch.randn(5, 8)).sum().backward()
    data = json.loads(json.dumps(memory_timeline_data(t)))
    pts = data["points"]
    assert data["device"] == "cpu" and data["source"] == "storages"
    assert len(pts) == sum(1 for e in t.memory if e["action"] in ("alloc", "free"))
    assert set(pts[0]) == {"seq", "allocated", "reserved", "owner", "phase", "action", "bytes"}
    peak = pts[data["peak"]]
    assert peak["allocated"] == max(p["allocated"] for p in pts) and peak["phase"] == "forward"
    assert [p["seq"] for p in pts] == sorted(p["seq"] for p in pts)
    back = [p["seq"] for p in pts if p["phase"] == "backward"]
    assert data["backward"] == [[back[0], back[-1]]]
    thin = memory_timeline_data(t, max_points=6)
    assert len(thin["points"]) < len(pts) and thin["points"][thin["peak"]]["allocated"] == peak["allocated"]


def test_plot_png_and_svg(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    with record_memory() as rec:
        planted_model()(torch.randn(5, 8)).sum().backward()
    png, svg = os.fspath(tmp_path / "m.png"), os.fspath(tmp_path / "m.svg")
    rec.plot(png)
    rec.plot(svg)
    with open(png, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(svg, encoding="utf-8") as fh:
        assert "<svg" in fh.read()
    with pytest.raises(ValueError, match=r"\.png, \.svg"):
        rec.plot(os.fspath(tmp_path / "m.gif"))
    from tracer.analysis.memory_views import PlotUnavailable

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(PlotUnavailable, match=r"^plot needs matplotlib: pip install"):
        rec.plot(png)


def test_memory_summary_on_cpu_counts_a_new_tensor_exactly():
    s0 = memory_summary("cpu")
    kept = torch.empty(12345, dtype=torch.float64)
    s1 = memory_summary("cpu")
    assert s1["tensor_bytes"] - s0["tensor_bytes"] == kept.untyped_storage().nbytes() == 12345 * 8
    assert s1["rss"] > 0 and s1["max_rss"] >= s1["rss"] // 2
    assert any("keeps no statistics" in u for u in s1["unknown"])
    text = str(s1)
    assert "Not known on CPU" in text and "process RSS" in text


def test_listener_rejects_unknown_cuda_mode():
    with pytest.raises(ValueError, match="cuda must be"):
        MemoryListener(cuda="sometimes")


# ---- CUDA --------------------------------------------------------------------------------------------
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cuda
@requires_cuda
def test_cuda_summary_matches_memory_stats():
    keep = [torch.empty(n, device="cuda") for n in (100, 300_000, 5_000_000)]
    del keep[1]
    s = memory_summary()
    st = torch.cuda.memory_stats()
    assert s["device"] == f"cuda:{torch.cuda.current_device()}"
    assert s["allocated"] == st["allocated_bytes.all.current"]
    assert s["max_allocated"] == st["allocated_bytes.all.peak"]
    assert s["reserved"] == st["reserved_bytes.all.current"]
    assert s["max_reserved"] == st["reserved_bytes.all.peak"]
    assert s["fragmentation"] == pytest.approx(1 - st["allocated_bytes.all.current"] / st["reserved_bytes.all.current"])
    assert sum(p["segment_bytes"] for p in s["pools"].values()) == st["reserved_bytes.all.current"]
    assert sum(p["used_bytes"] for p in s["pools"].values()) == st["active_bytes.all.current"]
    assert s["pools"]["large"]["segment_bytes"] == st["reserved_bytes.large_pool.current"]
    assert s["pools"]["small"]["segment_bytes"] == st["reserved_bytes.small_pool.current"]
    assert sum(b["used"] + b["free"] for b in s["distribution"]) == \
        sum(p["used"] + p["free"] for p in s["pools"].values())
    assert s["cached_free"] == st["reserved_bytes.all.current"] - st["active_bytes.all.current"]
    assert "Caching allocator" in str(s)
    del keep


@pytest.mark.cuda
@requires_cuda
def test_cuda_planted_temporary_and_names_from_allocator_history():
    model = planted_model().cuda()
    x = torch.randn(5, 8, device="cuda")

    def planted_forward(self, x):
        tmp = torch.zeros(PLANTED, device="cuda")
        return self.lin(x) + tmp[:16].sum()

    model[2].forward = planted_forward.__get__(model[2])
    model(x).sum().backward()  # warm-up: cuBLAS takes its workspace (32 MiB on Hopper) from the allocator once
    model.zero_grad(set_to_none=True)
    with record_memory() as rec:
        loss = model(x).pow(2).mean()
        loss.backward()
    assert rec.source("cuda:0") == "history"
    assert sum(e["bytes"] for e in rec.allocs if e["owner"] == "zeros0") == PLANTED * 4
    assert [e["tensor"] for e in rec.allocs if e["owner"] == "zeros0"] == ["zeros0:out"]
    peak = rec.peak_of("cuda:0")
    assert peak is not None and peak.tensors[0].name == "zeros0:out" and peak.tensors[0].producer == "zeros0"
    start, end = rec.marker("start", "cuda:0"), rec.marker("end", "cuda:0")
    assert rec.net("cuda:0") == end["requested"] - start["requested"]
    assert all(e["owner"] in {n.name for n in rec.trace.grad_nodes} | {"backward0"}
               for e in rec.frees if e["phase"] == "backward" and e["device"] == "cuda:0")


def gpt2_step_record(device: str = "cuda", listener: MemoryListener | None = None) -> tuple[MemoryRecord, tracer.Trace]:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=1000, n_positions=256)
    model = tf.GPT2LMHeadModel(cfg).to(device).train()
    ids = torch.randint(0, 1000, (8, 256), device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    listeners = [listener] if listener is not None else None
    with tracer.trace(hash="none", memory=listener is None, listeners=listeners) as t:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
    return MemoryRecord.from_trace(t), t


@pytest.mark.cuda
@requires_cuda
def test_cuda_gpt2_step_attributes_at_least_95_percent():
    rec, _t = gpt2_step_record()
    frac = rec.attributed_fraction("cuda:0")
    inside = rec.attributed_fraction("cuda:0", inside_only=True)
    start, end = rec.marker("start", "cuda:0"), rec.marker("end", "cuda:0")
    print(f"\nGPT-2 step on CUDA: {len(rec.allocs)} allocs, attributed {frac:.2%} of allocated bytes "
          f"({inside:.2%} while the owner ran); net {rec.net('cuda:0')} B; {rec.peak}")
    assert frac >= 0.95
    assert rec.net("cuda:0") == end["requested"] - start["requested"]
    last = [e for e in rec.events if e["device"] == "cuda:0" and e["action"] in ("alloc", "free")][-1]
    assert last["allocated_after"] == end["allocated_after"]
    assert last["reserved_after"] == end["reserved_after"]


@pytest.mark.cuda
@requires_cuda
def test_cuda_deltas_mode_accounts_every_byte():
    rec, _t = gpt2_step_record(listener=MemoryListener(cuda="deltas"))
    start, end = rec.marker("start", "cuda:0"), rec.marker("end", "cuda:0")
    assert rec.source("cuda:0") == "deltas"
    assert rec.net("cuda:0") == end["requested"] - start["requested"]
    assert rec.attributed_fraction("cuda:0") >= 0.95


_FRAG_SCRIPT = """
import json, torch
from tests.test_memory import gpt2_step_record
from tracer.features.memory import memory_summary
rec, _ = gpt2_step_record()
s = memory_summary()
print(json.dumps({k: s[k] for k in ("fragmentation", "free_fragmentation", "reserved", "max_reserved",
                                     "allocated", "max_allocated", "expandable_segments")}))
"""


@pytest.mark.cuda
@requires_cuda
def test_cuda_expandable_segments_change_fragmentation():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    results = {}
    for conf in ("", "expandable_segments:True"):
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf, "PYTHONPATH": root}
        out = subprocess.run([sys.executable, "-c", _FRAG_SCRIPT], env=env, cwd=root, capture_output=True, text=True,
                             check=True).stdout
        results[conf or "default"] = json.loads(out.strip().splitlines()[-1])
    print("\n" + json.dumps(results, indent=1))
    default, expandable = results["default"], results["expandable_segments:True"]
    assert (default["expandable_segments"], expandable["expandable_segments"]) == (False, True)
    assert expandable["max_reserved"] < default["max_reserved"]
    assert expandable["fragmentation"] != default["fragmentation"]


def test_csv_cells_from_the_trace_cannot_run_as_formulas(tmp_path):
    """Module names come from the user's model and from trace files (untrusted): a cell that a
    spreadsheet would run as a formula gets a leading apostrophe; numbers are left alone."""
    from tracer.analysis.memory_views import csv_cell

    model = torch.nn.Sequential()
    for name in ("=HYPERLINK(\"http://evil/x\")", "+1", "@SUM(A1)", "-2"):
        model.add_module(name, torch.nn.Linear(4, 4))
    with tracer.trace(hash="none", memory=True) as t:
        model(torch.randn(2, 4)).sum().backward()
    path = os.fspath(tmp_path / "mem.csv")
    MemoryRecord.from_trace(t).to_csv(path)
    with open(path, newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    modules = {r["module"] for r in rows if r["module"]}
    assert "'=HYPERLINK(\"http://evil/x\")" in modules and "'+1" in modules
    assert all(not v.startswith(("=", "+", "-", "@")) for r in rows for v in r.values())
    assert csv_cell(-5) == -5 and csv_cell(None) == "" and csv_cell("\tx") == "'\tx" and csv_cell("a=b") == "a=b"


def test_memory_plot_without_matplotlib_is_one_line_before_any_table(tmp_trace, tmp_path, monkeypatch, capsys):
    from export.cli import main

    with tracer.trace(hash="none", memory=True) as t:
        planted_model()(torch.randn(5, 8)).sum().backward()
    t.save(tmp_trace)
    png = tmp_path / "m.png"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as where it is not installed
    assert main(["memory", tmp_trace, "--plot", os.fspath(png)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == "gradtrace memory: error: --plot needs matplotlib: pip install 'gradtrace[memory]' (or matplotlib)\n"
    assert not png.exists()
