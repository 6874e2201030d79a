"""The kernels of `persistent_read.py` (a module of its own: Triton's jit wants its functions at module level).
They only read: each program sums the int32 words it reads, so the work left is the memory traffic."""
import triton
import triton.language as tl

# polls a barrier makes before it gives up (~0.5-1 us each: 30-60 ms, against 0.4 ms for the longest phase, the
# lm head's read)
MAX_POLLS = tl.constexpr(1 << 16)


@triton.jit
def grid_barrier(counter_ptr, target):
    """Every program of the grid waits here until all have arrived: each adds 1 to a counter zeroed before the
    launch and spins until it reaches `target` (the programs times the barriers passed so far). Only correct
    while every program of the grid is resident at once; where they are not (more programs than fit on the SMs
    beside each other: 2 per SM hung the early-load variant on an H100, lab notes (26)), the waiting ones would
    spin forever, so a barrier gives up after MAX_POLLS polls and marks counter_ptr[1], and the run is void (the
    barriers after it then pass at once)."""
    tl.debug_barrier()  # the program's warps are all done with the phase before it arrives
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    polls = tl.where(tl.atomic_add(counter_ptr + 1, 0, sem="acquire", scope="gpu") != 0, MAX_POLLS, 0)
    while (seen < target) & (polls < MAX_POLLS):
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
        polls += 1
    if seen < target:
        tl.atomic_or(counter_ptr + 1, 1)
    tl.debug_barrier()


@triton.jit
def phases_kernel(src_ptr, starts_ptr, lens_ptr, small_ptr, out_ptr, counter_ptr, first, last, small_n,
                  BLOCK: tl.constexpr, BARRIER: tl.constexpr, EARLY: tl.constexpr, SMALL: tl.constexpr,
                  SMALL_BLOCK: tl.constexpr):
    """Phases first .. last - 1 in one launch: phase p's programs read its lens[p] words from src + starts[p]
    in turn (grid-stride over BLOCK-word tiles). BARRIER: a grid barrier before each phase after the first (a
    phase that depends on the one before, as a matmul on the last one's output does). EARLY: each program loads
    its first tile of the next phase before it waits at the barrier (weights never wait on activations). SMALL:
    that many small phases after each phase, each every program reading small_n words (from L2: a norm's or an
    activation's worth of work) and a barrier, as the step's norms, SiLU and sums would become."""
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    r = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), tl.int32)
    passed = 0
    for p in range(first, last):
        start = tl.load(starts_ptr + p)
        n = tl.load(lens_ptr + p)
        head = tl.zeros((BLOCK,), tl.int32)
        if EARLY:
            head = tl.load(src_ptr + start + pid * BLOCK + r, mask=pid * BLOCK + r < n, other=0)
        if BARRIER:
            if p > first:
                passed += 1
                grid_barrier(counter_ptr, progs * passed)
        acc += head
        for t in range(pid + progs * EARLY, tl.cdiv(n, BLOCK), progs):
            acc += tl.load(src_ptr + start + t * BLOCK + r, mask=t * BLOCK + r < n, other=0)
        for _ in range(SMALL):
            s = tl.arange(0, SMALL_BLOCK)
            for o in range(0, small_n, SMALL_BLOCK):
                part = tl.load(small_ptr + o + s, mask=o + s < small_n, other=0)
                acc += tl.sum(part, 0) * (r == 0)
            passed += 1
            grid_barrier(counter_ptr, progs * passed)
    tl.store(out_ptr + pid * BLOCK + r, acc)


@triton.jit
def small_kernel(small_ptr, out_ptr, small_n, SMALL_BLOCK: tl.constexpr):
    """One program reading small_n words: a launch with a norm's worth of work (the step's small launches)."""
    s = tl.arange(0, SMALL_BLOCK)
    acc = tl.zeros((SMALL_BLOCK,), tl.int32)
    for o in range(0, small_n, SMALL_BLOCK):
        acc += tl.load(small_ptr + o + s, mask=o + s < small_n, other=0)
    tl.store(out_ptr + s, acc)
