"""The Triton kernels behind ``tracer.record.checksums.fused`` (imported only where Triton is used).

``partials``: one program per 256 KiB of a tensor (a batch of tensors per launch, found by a
binary search over the batch's first-program table) reads its bytes once and writes partial
stats and fingerprint lane sums (or, for the step log, lane sums and the sum of the squares:
an L2 norm from the same read). ``finalize``: one program per tensor folds its partials in a
fixed order and applies the fingerprint's final mix. The constants are those of
``tracer.record.checksums.fingerprint``, which defines the algorithm.
"""


import triton
import triton.language as tl

# The algorithm's constants are written as literals, not as module-level tl.constexpr globals:
# Triton re-checks every global a kernel reads on each launch (~25 µs per launch for these 18).
# They are tracer.record.checksums.fingerprint's KEY_A, KEY_B, FMIX_A, FMIX_B and LENGTH_SALT;
# tests/test_fused.py runs the kernels against that module's reference.

@triton.jit
def fmix_a(h):
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)

@triton.jit
def fmix_b(h):
    h = h ^ (h >> 16)
    h = h * 0x7FEB352D
    h = h ^ (h >> 15)
    h = h * 0x846CA68B
    return h ^ (h >> 16)

@triton.jit
def _stats_step(x, m, vmin, vmax, vabs, vsum, nnan, nfin):
    # Element-wise accumulation: no cross-thread reduction inside the loop.
    fin = m & (x == x) & (tl.abs(x) != float("inf"))
    vmin = tl.minimum(vmin, tl.where(fin, x, float("inf")))
    vmax = tl.maximum(vmax, tl.where(fin, x, float("-inf")))
    vabs = tl.maximum(vabs, tl.where(fin, tl.abs(x), 0.0))
    vsum += tl.where(fin, x, 0.0)
    nnan += (m & (x != x)).to(tl.int32)
    nfin += fin.to(tl.int32)
    return vmin, vmax, vabs, vsum, nnan, nfin


@triton.jit
def _fp_step(w, m, key_a, key_b, lane_a, lane_b):
    lane_a += tl.where(m, fmix_a(w ^ key_a), 0).to(tl.uint32)
    lane_b += tl.where(m, fmix_b(w ^ key_b), 0).to(tl.uint32)
    return lane_a, lane_b


@triton.jit(do_not_specialize=["n_tensors"])
def partials(meta_ptr, out_f_ptr, out_i_ptr, n_tensors,
             EDT: tl.constexpr, ESIZE: tl.constexpr, ACC: tl.constexpr, STATS: tl.constexpr,
             FP: tl.constexpr, SQ: tl.constexpr, CHUNK: tl.constexpr, LOG2B: tl.constexpr,
             ALIGNED: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    # Which tensor this program reads: the last whose first program is <= pid.
    lo = pid * 0
    hi = lo + n_tensors
    for _ in tl.static_range(LOG2B):
        mid = (lo + hi) // 2
        right = tl.load(meta_ptr + mid * 4 + 3) <= pid
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    addr = tl.load(meta_ptr + lo * 4)
    numel = tl.load(meta_ptr + lo * 4 + 1)
    nprog = tl.load(meta_ptr + lo * 4 + 2)
    p = pid - tl.load(meta_ptr + lo * 4 + 3)
    if ALIGNED:  # every tensor of the batch starts on 16 bytes: wide vector loads
        addr = tl.multiple_of(addr, 16)
    nbytes = numel * ESIZE
    nwords = nbytes // 4
    nchunks = (nbytes + CHUNK - 1) // CHUNK
    nfull = nbytes // CHUNK
    CE: tl.constexpr = CHUNK // ESIZE
    CW: tl.constexpr = CHUNK // 4
    # Offsets inside a chunk are 32-bit; the chunk's base is added to the pointer in 64 bits, so
    # tensors past 2^31 elements address correctly without 64-bit math per element.
    eoffs = tl.arange(0, CE)
    woffs = tl.arange(0, CW).to(tl.uint32)
    all_w = woffs < CW
    # A chunk never straddles a multiple of 2^32 words (CW divides it): within one, the key is a
    # per-chunk scalar plus the word's offset times the multiplier, precomputed here.
    koffs_a = woffs * 0x9E3779B1
    koffs_b = woffs * 0x85EBCA77
    eptr = addr.to(tl.pointer_type(EDT))
    wptr = addr.to(tl.pointer_type(tl.int32))
    # Stats, first pass: min, max and sum only (three operations per element). A sum is finite
    # only if every element is, so a finite sum proves the pass exact; a program whose bytes
    # hold a NaN or Inf reads them again below with the masked, counting accumulation.
    vmin = tl.full((CE,), float("inf"), ACC)
    vmax = tl.full((CE,), float("-inf"), ACC)
    vsum = tl.zeros((CE,), ACC)
    # SQ (without STATS): the sum of the squares, for an L2 norm read in the same pass as the
    # fingerprint (the step log's), written where STATS writes the sum.
    vsq = tl.zeros((CE,), ACC)
    count = pid * 0
    lane_a = tl.zeros((CW,), tl.uint32)
    lane_b = tl.zeros((CW,), tl.uint32)
    c = p
    while c < nchunks:
        base = c * CW
        blo = (base & 0xFFFFFFFF).to(tl.uint32)
        bhi = (base >> 32).to(tl.uint32)
        key_a = koffs_a + (blo * 0x9E3779B1 + bhi * 0x7FEB352D + 0x243F6A88)
        key_b = koffs_b + (blo * 0x85EBCA77 + bhi * 0x68E31DA4 + 0xB7E15162)
        if c < nfull:
            if STATS:
                x = tl.load(eptr + c * CE + eoffs).to(ACC)
                vmin = tl.minimum(vmin, x)
                vmax = tl.maximum(vmax, x)
                vsum += x
                count += CE
            if FP:
                w = tl.load(wptr + base + woffs).to(tl.uint32, bitcast=True)
                lane_a, lane_b = _fp_step(w, all_w, key_a, key_b, lane_a, lane_b)
            if SQ:
                x = tl.load(eptr + c * CE + eoffs).to(ACC)
                vsq += x * x
        else:  # the last, partial chunk
            if STATS:
                left = numel - c * CE
                m = eoffs < left
                x = tl.load(eptr + c * CE + eoffs, mask=m, other=0).to(ACC)
                vmin = tl.minimum(vmin, tl.where(m, x, float("inf")))
                vmax = tl.maximum(vmax, tl.where(m, x, float("-inf")))
                vsum += x
                count += left
            if FP:
                wm = woffs.to(tl.int64) < nwords - base
                w = tl.load(wptr + base + woffs, mask=wm, other=0).to(tl.uint32, bitcast=True)
                lane_a, lane_b = _fp_step(w, wm, key_a, key_b, lane_a, lane_b)
            if SQ:
                x = tl.load(eptr + c * CE + eoffs, mask=eoffs < numel - c * CE, other=0).to(ACC)
                vsq += x * x
        c += nprog
    lo_v = tl.min(vmin, axis=0).to(tl.float64)
    hi_v = tl.max(vmax, axis=0).to(tl.float64)
    sum_v = tl.sum(vsum.to(tl.float64), axis=0)
    if SQ:
        sum_v = tl.sum(vsq.to(tl.float64), axis=0)
    abs_v = tl.maximum(tl.abs(lo_v), tl.abs(hi_v))
    nan_v = pid * 0
    fin_v = count
    if STATS:  # noqa: SIM102 (a compile-time branch: Triton cannot join it with a runtime one)
        if (sum_v != sum_v) | (tl.abs(sum_v) == float("inf")):
            emin = tl.full((CE,), float("inf"), ACC)
            emax = tl.full((CE,), float("-inf"), ACC)
            eabs = tl.zeros((CE,), ACC)
            esum = tl.zeros((CE,), ACC)
            nnan = tl.zeros((CE,), tl.int32)
            nfin = tl.zeros((CE,), tl.int32)
            c = p
            while c < nchunks:
                m = eoffs < numel - c * CE
                x = tl.load(eptr + c * CE + eoffs, mask=m, other=0).to(ACC)
                emin, emax, eabs, esum, nnan, nfin = _stats_step(x, m, emin, emax, eabs, esum, nnan, nfin)
                c += nprog
            lo_v = tl.min(emin, axis=0).to(tl.float64)
            hi_v = tl.max(emax, axis=0).to(tl.float64)
            sum_v = tl.sum(esum.to(tl.float64), axis=0)
            abs_v = tl.max(eabs, axis=0).to(tl.float64)
            nan_v = tl.sum(nnan.to(tl.int64), axis=0)
            fin_v = tl.sum(nfin.to(tl.int64), axis=0)
    sum_a = tl.sum(lane_a, axis=0).to(tl.uint32)
    sum_b = tl.sum(lane_b, axis=0).to(tl.uint32)
    if FP:
        # The last partial word (byte lengths not a multiple of 4), zero-padded, by program 0.
        tail = nbytes - nwords * 4
        if (p == 0) & (tail > 0):
            k = tl.arange(0, 4)
            bptr = addr.to(tl.pointer_type(tl.uint8))
            bts = tl.load(bptr + nwords * 4 + k, mask=k < tail, other=0).to(tl.uint32)
            w = tl.sum(bts << (k * 8).to(tl.uint32), axis=0).to(tl.uint32)
            ilo = (nwords & 0xFFFFFFFF).to(tl.uint32)
            ihi = (nwords >> 32).to(tl.uint32)
            sum_a += fmix_a(w ^ (ilo * 0x9E3779B1 + ihi * 0x7FEB352D + 0x243F6A88))
            sum_b += fmix_b(w ^ (ilo * 0x85EBCA77 + ihi * 0x68E31DA4 + 0xB7E15162))
    tl.store(out_f_ptr + pid * 4, lo_v)
    tl.store(out_f_ptr + pid * 4 + 1, hi_v)
    tl.store(out_f_ptr + pid * 4 + 2, sum_v)
    tl.store(out_f_ptr + pid * 4 + 3, abs_v)
    tl.store(out_i_ptr + pid * 4, nan_v)
    tl.store(out_i_ptr + pid * 4 + 1, fin_v)
    tl.store(out_i_ptr + pid * 4 + 2, sum_a.to(tl.int64))
    tl.store(out_i_ptr + pid * 4 + 3, sum_b.to(tl.int64))


# The element size is a plain argument, not specialised on: one compilation serves every dtype
# (a process's first trace start waits for each compilation of its common dtypes).
@triton.jit(do_not_specialize=["esize"])
def finalize(meta_ptr, out_f_ptr, out_i_ptr, res_f_ptr, res_i_ptr, esize,
             PBLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    numel = tl.load(meta_ptr + i * 4 + 1)
    nprog = tl.load(meta_ptr + i * 4 + 2)
    start = tl.load(meta_ptr + i * 4 + 3)
    vmin = tl.full((), float("inf"), tl.float64)
    vmax = tl.full((), float("-inf"), tl.float64)
    vsum = tl.full((), 0.0, tl.float64)
    vabs = tl.full((), 0.0, tl.float64)
    nnan = i * 0
    nfin = i * 0
    lane_a = tl.full((), 0, tl.uint32)
    lane_b = tl.full((), 0, tl.uint32)
    # Partials in blocks, always in the same order: the float sum is reproducible.
    j = i * 0
    while j < nprog:
        k = j + tl.arange(0, PBLOCK).to(tl.int64)
        m = k < nprog
        rows = start + k
        vmin = tl.minimum(vmin, tl.min(tl.load(out_f_ptr + rows * 4, mask=m, other=float("inf")), axis=0))
        vmax = tl.maximum(vmax, tl.max(tl.load(out_f_ptr + rows * 4 + 1, mask=m, other=float("-inf")), axis=0))
        vsum += tl.sum(tl.load(out_f_ptr + rows * 4 + 2, mask=m, other=0.0), axis=0)
        vabs = tl.maximum(vabs, tl.max(tl.load(out_f_ptr + rows * 4 + 3, mask=m, other=0.0), axis=0))
        nnan += tl.sum(tl.load(out_i_ptr + rows * 4, mask=m, other=0), axis=0)
        nfin += tl.sum(tl.load(out_i_ptr + rows * 4 + 1, mask=m, other=0), axis=0)
        lane_a += tl.sum(tl.load(out_i_ptr + rows * 4 + 2, mask=m, other=0).to(tl.uint32), axis=0).to(tl.uint32)
        lane_b += tl.sum(tl.load(out_i_ptr + rows * 4 + 3, mask=m, other=0).to(tl.uint32), axis=0).to(tl.uint32)
        j += PBLOCK
    nbytes = numel * esize
    nlo = (nbytes & 0xFFFFFFFF).to(tl.uint32)
    nhi = (nbytes >> 32).to(tl.uint32)
    fa = fmix_a(lane_a + fmix_a(nlo ^ 0x5851F42D ^ fmix_a(nhi)))
    fb = fmix_b(lane_b + fmix_b(nlo ^ 0x4C957F2D ^ fmix_b(nhi)))
    tl.store(res_f_ptr + i * 4, vmin)
    tl.store(res_f_ptr + i * 4 + 1, vmax)
    tl.store(res_f_ptr + i * 4 + 2, vsum / tl.maximum(nfin, 1).to(tl.float64))
    tl.store(res_f_ptr + i * 4 + 3, vabs)
    tl.store(res_i_ptr + i * 4, nnan)
    tl.store(res_i_ptr + i * 4 + 1, numel - nnan - nfin)
    tl.store(res_i_ptr + i * 4 + 2, fa.to(tl.int64))
    tl.store(res_i_ptr + i * 4 + 3, fb.to(tl.int64))
