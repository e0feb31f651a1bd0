"""parallel.SteadyAllocations, the CPU allocator's warm-up around a repeated step (DataParallel's
fused step uses it): the first step's blocks are recorded per size class, entering the second
fills the allocator's free lists, and a step that raises is not counted."""
import gc

import pytest

import mgpu
from mgpu import parallel


def test_the_second_step_finds_the_first_steps_small_blocks_twice_and_four_more():
    gc.collect()  # earlier tests' garbage freed now, not during the steps below
    mgpu.waitall()
    mgpu.empty_cache()
    live = mgpu.cpu_memory_stats()["allocated"]  # what other tests still hold
    warm = parallel.SteadyAllocations()
    with warm:
        held = [mgpu.zeros((1000,)) for _ in range(3)]  # 4000 bytes each: one small class
        mgpu.waitall()
        del held
    assert warm.steps == 1
    [(size, n)] = warm.trace.items()
    assert n == 3 and 4000 <= size <= 65536
    before = mgpu.cpu_memory_stats()
    assert before["allocated"] == live and before["cached"] == 3 * size
    with warm:
        pass
    after = mgpu.cpu_memory_stats()
    assert after["cached"] == (2 * n + 4) * size
    assert after["system_mallocs"] - before["system_mallocs"] == n + 4
    with warm:  # later steps reserve nothing more
        pass
    assert mgpu.cpu_memory_stats() == after
    assert warm.steps == 3


def test_a_step_that_raises_is_not_counted_and_still_ends_the_trace():
    warm = parallel.SteadyAllocations()
    with pytest.raises(KeyError):
        with warm:
            mgpu.zeros((10,))
            raise KeyError("a failed step")
    assert warm.steps == 0
    with warm:  # the trace was stopped: a new one starts and ends
        mgpu.zeros((10,))
        mgpu.waitall()
    assert warm.steps == 1 and warm.trace
