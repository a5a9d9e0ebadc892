"""The training steps the benchmarks time: models built from ``transformers`` configs with random
weights (nothing is downloaded), their inputs, and one step (zero_grad, forward, backward, AdamW).

Models (``build``):

- ``gpt2-small``: the released GPT-2 124M architecture (``GPT2Config()``); 8 x 1024 tokens on
  CUDA, 1 x 64 on the CPU.
- ``llama``: a Llama-style decoder (``LlamaConfig``): 12 layers, hidden 768, 12 attention heads
  over 4 key/value heads (GQA), SwiGLU intermediate size 2048, vocabulary 32,000; 8 x 1024
  tokens on CUDA, 1 x 64 on the CPU.
- ``resnet50``: ResNet-50 (``ResNetConfig``: bottleneck blocks, depths 3/4/6/3, hidden sizes
  256/512/1024/2048, 1000 labels) with a cross-entropy loss; 64 x 3 x 224 x 224 images on
  CUDA, 2 x 3 x 64 x 64 on the CPU.
- ``vit``: ViT-Base/16 (``ViTConfig()``: 12 layers, hidden 768, 224 x 224 images in 16 x 16
  patches, 1000 labels) with a cross-entropy loss; 64 x 3 x 224 x 224 on CUDA, 2 x 3 x 224 x 224
  on the CPU.
- ``bert``: BERT-Base (``BertConfig()``: 12 layers, hidden 768, vocabulary 30,522) with its
  masked-LM head and loss over every token; 8 x 512 tokens on CUDA, 1 x 64 on the CPU.
- ``tiny`` / ``tiny12``: GPT-2 with 2 / 12 layers at width 64 (4 x 64 tokens);
  ``llama-tiny`` and ``resnet50-tiny``: the Llama-style and ResNet-50 architectures at their
  full depth but a tiny width (4 x 64 tokens; 4 x 3 x 32 x 32 images). A tiny-width model makes
  the same calls, grad nodes and tensor values per step as the full one while its ops cost
  little, so a recorder's per-object cost shows; the CPU suite uses them. ``vit-tiny`` and
  ``bert-tiny`` likewise (12 layers at width 64; 4 x 3 x 32 x 32 images in 4 x 4 patches, 4 x 64
  tokens): two more families, an encoder over patches and a bidirectional encoder, to check
  that a figure holds beyond the three workloads it was measured on.

Not a package: the scripts next to this file import it by putting their folder on ``sys.path``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

GPT_MODELS = ("tiny", "tiny12", "gpt2-small")
LLAMA_MODELS = ("llama", "llama-tiny")
RESNET_MODELS = ("resnet50", "resnet50-tiny")
VIT_MODELS = ("vit", "vit-tiny")
BERT_MODELS = ("bert", "bert-tiny")
MODELS = GPT_MODELS + LLAMA_MODELS + RESNET_MODELS + VIT_MODELS + BERT_MODELS
# Full-size models: few rounds by default, since one step is long.
LARGE_MODELS = ("gpt2-small", "llama", "resnet50", "vit", "bert")


@dataclass
class Workload:
    """One model, its inputs and its optimizer. ``inputs`` are the model's keyword arguments;
    ``labels`` (image classification only) are the targets of the cross-entropy loss, otherwise
    the language models' ``labels=input_ids`` give the causal-LM loss."""

    model: torch.nn.Module
    inputs: dict[str, torch.Tensor]
    opt: torch.optim.Optimizer
    device: torch.device
    autocast: torch.dtype | None = None
    labels: torch.Tensor | None = None
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ids(self) -> torch.Tensor:
        """The main input: token ids of a language model, images of an image model."""
        return self.inputs.get("input_ids", next(iter(self.inputs.values())))

    def loss(self) -> torch.Tensor:
        """The forward pass under the workload's autocast setting, returning the loss."""
        with torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None):
            if self.labels is None:
                return self.model(**self.inputs).loss
            logits = self.model(**self.inputs).logits
            return torch.nn.functional.cross_entropy(logits, self.labels)

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss()
        loss.backward()
        self.opt.step()

    def describe(self) -> str:
        """What one step processes, e.g. ``batch 8 x seq 1024`` or ``batch 64 x 3 x 224 x 224``."""
        if "input_ids" in self.inputs:
            b, s = self.inputs["input_ids"].shape
            return f"batch {b} x seq {s}"
        return "batch " + " x ".join(str(d) for d in self.ids.shape)


def build(model: str, device: torch.device, batch: int | None, seq: int | None,
          autocast: torch.dtype | None = None, foreach: bool | None = None) -> Workload:
    """The workload ``model`` (see the module's docstring) on ``device``. ``batch`` and ``seq``
    override the default sizes; for the image models ``seq`` is the image's side in pixels."""
    cpu = device.type == "cpu"
    torch.manual_seed(0)
    labels = None
    if model in GPT_MODELS:
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
            batch, seq = batch or (1 if cpu else 8), seq or (64 if cpu else 1024)
        m: torch.nn.Module = GPT2LMHeadModel(config)
        vocab = config.vocab_size
    elif model in LLAMA_MODELS:
        from transformers import LlamaConfig, LlamaForCausalLM

        if model == "llama":
            # Llama-style, GPT-2 small's size: 12 layers, d=768, GQA (12 query heads over 4 key/value
            # heads), SwiGLU MLP, RMSNorm, rotary positions, the Llama-2 vocabulary size.
            config = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                                 num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                                 max_position_embeddings=2048)
            batch, seq = batch or (1 if cpu else 8), seq or (64 if cpu else 1024)
        else:  # llama-tiny: the same 12 layers and 3:1 GQA at a tiny width
            config = LlamaConfig(vocab_size=256, hidden_size=96, intermediate_size=256,
                                 num_hidden_layers=12, num_attention_heads=6, num_key_value_heads=2,
                                 max_position_embeddings=128)
            batch, seq = batch or 4, seq or 64
        m = LlamaForCausalLM(config)
        vocab = config.vocab_size
    elif model in RESNET_MODELS:
        from transformers import ResNetConfig, ResNetForImageClassification

        if model == "resnet50":
            config = ResNetConfig(layer_type="bottleneck", depths=[3, 4, 6, 3], embedding_size=64,
                                  hidden_sizes=[256, 512, 1024, 2048], num_labels=1000)
            batch, seq = batch or (2 if cpu else 64), seq or (64 if cpu else 224)
        else:  # resnet50-tiny: the same 16 bottleneck blocks at an eighth of the width
            config = ResNetConfig(layer_type="bottleneck", depths=[3, 4, 6, 3], embedding_size=8,
                                  hidden_sizes=[32, 64, 128, 256], num_labels=10)
            batch, seq = batch or 4, seq or 32
        m = ResNetForImageClassification(config)
        vocab = 0
    elif model in VIT_MODELS:
        from transformers import ViTConfig, ViTForImageClassification

        if model == "vit":  # ViT-Base/16
            config = ViTConfig(num_labels=1000)
            batch, seq = batch or (2 if cpu else 64), seq or 224
        else:  # vit-tiny: the same 12 layers at width 64, 32 x 32 images in 4 x 4 patches
            config = ViTConfig(hidden_size=64, num_hidden_layers=12, num_attention_heads=4, intermediate_size=256,
                               image_size=32, patch_size=4, num_labels=10)
            batch, seq = batch or 4, seq or 32
        config.image_size = seq
        m = ViTForImageClassification(config)
        vocab = 0
    elif model in BERT_MODELS:
        from transformers import BertConfig, BertForMaskedLM

        if model == "bert":  # BERT-Base
            config = BertConfig()
            batch, seq = batch or (1 if cpu else 8), seq or (64 if cpu else 512)
        else:  # bert-tiny: the same 12 layers at width 64
            config = BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=12, num_attention_heads=4,
                                intermediate_size=256, max_position_embeddings=128)
            batch, seq = batch or 4, seq or 64
        m = BertForMaskedLM(config)
        vocab = config.vocab_size
    else:
        raise ValueError(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
    m = m.to(device).train()
    if vocab:
        # the model's own loss, named to avoid transformers' warning
        m.loss_type = "ForMaskedLM" if model in BERT_MODELS else "ForCausalLM"
        ids = torch.randint(0, vocab, (batch, seq), device=device)
        inputs = {"input_ids": ids, "labels": ids}
    else:
        inputs = {"pixel_values": torch.randn(batch, 3, seq, seq, device=device)}
        labels = torch.randint(0, config.num_labels, (batch,), device=device)
    # foreach=None is torch's default: the multi-tensor AdamW on CUDA, the per-parameter one on CPU.
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=foreach)
    return Workload(m, inputs, opt, device, autocast, labels, model)


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


# What time_step reads: wall time, or this process's CPU time (``use_clock("process")``, CPU
# workloads only): on a small shared host another process's work then does not count, which
# steadies an A/B of two configurations (what a step waits for, I/O or a GPU, does not count either).
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "process": time.process_time}
_clock: Callable[[], float] = time.perf_counter


def use_clock(name: str) -> None:
    global _clock
    _clock = CLOCKS[name]


def time_step(w: Workload, make_ctx: Factory) -> tuple[float, float, Any]:
    """Milliseconds of one step under the context manager, milliseconds until the step's Python
    code returned (before the manager's exit and the final sync: on a GPU, the time the CPU
    spent issuing work), and what the manager gave (a Trace)."""
    sync = torch.cuda.synchronize if w.device.type == "cuda" else (lambda: None)
    clock = _clock
    sync()
    t0 = clock()
    with make_ctx() as value:
        w.step()
        t1 = clock()
    sync()
    return (clock() - t0) * 1000.0, (t1 - t0) * 1000.0, value


def element_size(dtype: str) -> int:
    """Bytes per element of a dtype named as in a trace (``"float32"``); 0 if torch has no such dtype."""
    d = getattr(torch, dtype.removeprefix("torch."), None)
    return torch.empty((), dtype=d).element_size() if isinstance(d, torch.dtype) else 0


def recorded_bytes(trace: Any) -> int:
    """Bytes of the tensor values a trace recorded (``numel * element_size`` of every record of
    ``trace.tensors``, leaving out memory nobody wrote): what checksumming them must read."""
    sizes: dict[str, int] = {}
    total = 0
    for rec in trace.tensors.values():
        if getattr(rec, "uninitialized", False):
            continue
        if rec.dtype not in sizes:
            sizes[rec.dtype] = element_size(rec.dtype)
        total += rec.numel * sizes[rec.dtype]
    return total


def recorded_objects(trace: Any) -> int:
    """Calls + grad nodes + tensor values one trace recorded (the recorder's unit of work)."""
    return len(trace.calls) + len(trace.grad_nodes) + len(trace.tensors)
