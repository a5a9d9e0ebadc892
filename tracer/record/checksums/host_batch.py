"""``hash="fast"`` on the CPU: fingerprints of many small tensors in one pass.

A step makes hundreds of tensors of tens of kilobytes; a dozen torch ops per tensor cost more
than the bytes (each op costs microseconds before it reads anything). Here each tensor's bytes
are copied into a staging buffer when it is recorded (a snapshot: later in-place changes cannot
reach it), starting on a block boundary, and when the buffer fills (or the block ends) about
fifteen ops compute every fingerprint in it:

- the buffer is viewed as blocks of ``BLOCK`` words; a word's index key is its index within its
  own tensor, so each block gets the key of its first word (a column) added to one shared row of
  ``o * K0`` (keys are linear in the index within a block: see ``fingerprint.py``);
- one reduction gives each block's two lane sums, and a tensor's sums are its blocks' sums;
- the zero words after a tensor's end, up to its last block's end, are in those sums: their
  terms depend only on where the tensor ends, and are subtracted (cached per length; the same
  lengths recur every step). A tensor that does not fill its last block has the rest of that
  block zeroed when it is staged.

Tensors larger than half the buffer are fingerprinted directly (``lane_sums_host``), no copy.
On a 2-core host a worker thread for the passes was slower (it competes with torch's own
threads, and fresh buffers fault their pages in): the passes run on the recording thread.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from tracer.model import TensorRecord
from tracer.record.checksums import fingerprint as fp
from tracer.record.checksums.bytes import as_bytes
from tracer.record.own_work import HOST
from tracer.record.tensors import storage_start

BLOCK = 1024  # words per block (4 KiB): a tensor's staged bytes start on a block boundary
# Blocks per pass: 2 MiB of staged bytes (9% faster than 1 MiB on a step's mix of sizes; the
# pass's work buffers are 4 MiB each).
BATCH_BLOCKS = 512
RAW_COPY = True  # contiguous tensors staged by memmove (False: by torch ops; A/B runs)


@functools.cache
def _row() -> torch.Tensor:
    """[2, 1, BLOCK] int32: o * K0 of each lane for o < BLOCK (int32 products wrap modulo 2^32)."""
    with torch.inference_mode(False):  # cached for the process: a normal tensor whatever the mode now
        o = torch.arange(BLOCK, dtype=torch.int32, device=HOST)
        return torch.stack([o * fp.s32(fp.KEY_A[0]), o * fp.s32(fp.KEY_B[0])]).view(2, 1, BLOCK)


@functools.cache
def _block_keys() -> tuple[list[int], list[int]]:
    """The key of block j's first word (index j * BLOCK in its tensor), per lane, as int32 bit
    patterns, for the blocks a staged tensor can have."""
    firsts = [j * BLOCK for j in range(BATCH_BLOCKS)]
    return ([fp.s32(f * fp.KEY_A[0] + fp.KEY_A[2]) for f in firsts],
            [fp.s32(f * fp.KEY_B[0] + fp.KEY_B[2]) for f in firsts])


@functools.lru_cache(maxsize=4096)
def _padding_terms(words: int) -> tuple[int, int]:
    """The lane terms of the zero words at indices ``words`` .. the end of their block."""
    end = -(-words // BLOCK) * BLOCK
    if end == words:
        return 0, 0
    i = torch.arange(words, end, dtype=torch.int64, device=HOST)
    keys = torch.stack([(i * fp.KEY_A[0] + fp.KEY_A[2]) & fp.MASK32, (i * fp.KEY_B[0] + fp.KEY_B[2]) & fp.MASK32])
    h = torch.where(keys >= 1 << 31, keys - (1 << 32), keys).to(torch.int32)
    a, b = fp.fmix_lanes_(h).sum(dim=1, dtype=torch.int64).tolist()
    return a & fp.MASK32, b & fp.MASK32


Staged = list[tuple[TensorRecord, int, int, int, int]]  # (record, first block, blocks, words, bytes)


def _holds(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage holds memory (FSDP resizes storages to 0 between uses): reading
    a freed one would crash the process, by memmove or by torch's own ``copy_``. Read off the
    tensor: asking the storage itself (``untyped_storage()``) would leave a Python object holding
    it for good, and autograd then stops summing gradients into it in place (see
    ``tracer.record.tensors.storage_key``)."""
    return storage_start(t) != 0


class HostFingerprints:
    """Staged CPU fingerprints; ``add`` fills a record now or at the next ``flush``."""

    def __init__(self) -> None:
        # Normal tensors even when the first tensor staged was made under torch.inference_mode:
        # the buffers are written in place by later passes, which inference tensors refuse
        # outside that mode.
        with torch.inference_mode(False):
            self._stage = torch.zeros(BATCH_BLOCKS * BLOCK, dtype=torch.int32, device=HOST)
            # The pass's two lane blocks and its scratch (also the large tensors' work buffers),
            # kept for the trace instead of allocated per pass.
            self._lanes = torch.empty(2 * BATCH_BLOCKS * BLOCK, dtype=torch.int32, device=HOST)
            self._scratch = torch.empty(2 * BATCH_BLOCKS * BLOCK, dtype=torch.int32, device=HOST)
            # (a view made under inference mode refuses in-place writes outside it, too)
            self._stage_bytes = self._stage.view(torch.uint8)
        self._stage_addr = self._stage.data_ptr()
        self._used = 0  # blocks
        self._waiting: Staged = []

    def add(self, rec: TensorRecord, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        words = (n + 3) // 4
        blocks = -(-words // BLOCK)
        if blocks * 2 > BATCH_BLOCKS:  # large: on its own, now
            a, bb = fp.lane_sums_host(t, (self._lanes, self._scratch))
            rec.fingerprint = fp.finish(a, bb, n)
            return
        if self._used + blocks > BATCH_BLOCKS:
            self.flush()
        start = self._used
        at = start * BLOCK * 4
        pad = blocks * BLOCK * 4 - n
        if n and not _holds(t):  # (torch's own copy_ crashes the process on such a tensor)
            raise RuntimeError("its storage does not hold its bytes (freed or shrunk)")
        if RAW_COPY and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
            # Its bytes lie in row-major order at data_ptr(): copied and padded with two C
            # calls. Two torch ops (copy_, zero_) cost 10-20 µs a tensor inside a traced step
            # (their code cold after the recorder's Python), more than most tensors' bytes.
            dst = self._stage_addr + at
            ctypes.memmove(dst, t.data_ptr(), n)
            if pad:
                ctypes.memset(dst + n, 0, pad)
        else:
            copy = self._stage_bytes.narrow(0, at, n)
            try:
                # The values in row-major order in their own dtype: the bytes as_bytes gives
                # (copy_ reads any strides and applies a conjugate or negative bit).
                copy.view(t.dtype).view(t.shape).copy_(t.detach())
            except RuntimeError:  # a dtype whose bytes cannot be viewed so
                copy.copy_(as_bytes(t))
            if pad:  # the words after its end, to its last block's end, must read as zero
                self._stage_bytes.narrow(0, at + n, pad).zero_()
        self._used = start + blocks
        self._waiting.append((rec, start, blocks, words, n))

    def pending(self) -> list[TensorRecord]:
        """Records whose fingerprint is not filled in yet."""
        return [w[0] for w in self._waiting]

    def flush(self) -> None:
        """Fingerprint every staged tensor: one pass over the staged blocks."""
        waiting, self._waiting = self._waiting, []
        used, self._used = self._used, 0
        if waiting:
            size = 2 * used * BLOCK
            _fingerprint_pass(self._stage, used, waiting, self._lanes[:size].view(2, used, BLOCK),
                              self._scratch[:size].view(2, used, BLOCK))


@functools.lru_cache(maxsize=256)
def _block_bases(blocks: tuple[int, ...]) -> torch.Tensor:
    """[2, sum(blocks), 1] int32: the key of each staged block's first word, for tensors of
    ``blocks`` blocks staged one after another (a step stages the same sizes in the same order
    every time: built once per layout)."""
    keys_a, keys_b = _block_keys()
    bases_a: list[int] = []
    bases_b: list[int] = []
    for n in blocks:  # each block's first key: its index in its own tensor
        bases_a += keys_a[:n]
        bases_b += keys_b[:n]
    return torch.tensor([bases_a, bases_b], dtype=torch.int32, device=HOST).view(2, len(bases_a), 1)


def _fingerprint_pass(stage: torch.Tensor, used: int, waiting: Staged, h: torch.Tensor, tmp: torch.Tensor) -> None:
    """Fill in the fingerprints of the tensors staged in ``stage``'s first ``used`` blocks; ``h``
    and ``tmp`` are [2, used, BLOCK] int32 blocks to work in."""
    base = _block_bases(tuple([w[2] for w in waiting]))
    with torch._C.DisableTorchFunction():
        words = stage[:used * BLOCK]
        torch.add(_row(), base, out=h)  # [2, blocks, BLOCK]: every word's index key
        h.bitwise_xor_(words.view(1, used, BLOCK))
        fp.fmix_lanes_(h, tmp)
        # int32 sums wrap modulo 2^32, which is the definition (and 5x faster than int64 here).
        sums = h.sum(dim=2, dtype=torch.int32).tolist()
    sums_a, sums_b = sums
    finish, mask = fp.finish, fp.MASK32
    for rec, start, blocks, nwords, n in waiting:
        pad_a, pad_b = _padding_terms(nwords)
        a = sum(sums_a[start:start + blocks]) - pad_a
        b = sum(sums_b[start:start + blocks]) - pad_b
        rec.fingerprint = finish(a & mask, b & mask, n)
