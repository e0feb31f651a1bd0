"""Stream order that only exact events show: a DLPack producer on an emulated GPU whose own
stream still holds the work that writes the tensor when mgpu imports it.

The DLPack protocol: mgpu passes its import stream as `__dlpack__(stream=...)`, and the producer
orders its pending work before that stream (PyTorch records an event on its current stream and
makes the consumer's stream wait for it). mgpu then records its import fence on that stream and
makes the device's compute stream wait for the fence before its first use of the memory. A fence
recorded on another stream, or never waited for, lets mgpu's kernel read the memory while the
producer's writes are still queued: it reads NaN (the producer's earlier steps) or the memory's
old contents (zeros).

On the strict emulator (MGPU_EMU_STRICT=1, as .ci/test.sh runs this file) a stream's work runs
only when something waits for it (or at a random point of the seeded sequence), and an event
covers exactly the work issued before its record: the producer's writes stay queued until
mgpu's fence pulls them in, so a broken fence shows as wrong values for every seed tried
(several imports per test, each with its own random draws). On the lenient emulator work runs
as it is issued, and these tests check only the values.
"""
import ctypes
import os

import numpy as np
import pytest

import dlpack_abi as dl
import mgpu
from mgpu import _core

pytestmark = pytest.mark.gpu

NUM_GPUS = mgpu.num_gpus()
EMULATED = bool(mgpu.build_info()["cuda_emulation"])
SEED = f"MGPU_EMU_STRICT={os.environ.get('MGPU_EMU_STRICT', '0')} " \
       f"MGPU_EMU_SEED={os.environ.get('MGPU_EMU_SEED', '1')}"


class _PendingProducer:
    """A foreign producer of float32 memory on gpu(i), as PyTorch would be right after launching
    the kernels that compute a tensor: its own stream holds `steps` queued writes to the memory
    (NaN, then `values` last), none of them run yet. The memory is an mgpu tensor's, kept alive
    here and exported under this producer's own (no-op) deleter, so mgpu imports it as foreign
    memory, with its import fence."""

    def __init__(self, values, gpu_index, steps):
        self.owner = mgpu.array(np.zeros_like(values), device=mgpu.gpu(gpu_index))
        mgpu.waitall()
        own = self.owner._t.to_dlpack()
        managed = ctypes.cast(dl.capsule_pointer(own, b"dltensor"),
                              ctypes.POINTER(dl.DLManagedTensor)).contents
        self.data = managed.dl_tensor.data
        self.gpu_index = gpu_index
        self.stream = _core._emu_producer_write(gpu_index, self.data, values, steps)
        self.streams = []
        self._shape = (ctypes.c_int64 * 1)(values.size)
        self._deleter = dl.DELETER(lambda _: None)
        self._managed = dl.DLManagedTensor(
            dl.DLTensor(self.data, dl.DLDevice(2, gpu_index), 1, dl.DLDataType(2, 32, 1),
                        self._shape, None, 0), None, self._deleter)

    def __dlpack_device__(self):
        return (2, self.gpu_index)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.streams.append(stream)
        if stream is not None:
            _core._emu_producer_order_before(self.gpu_index, self.stream, stream)
        return dl.capsule_new(ctypes.addressof(self._managed), b"dltensor", None)

    def finish(self):
        """Waits for the producer's stream, once mgpu has given the memory back (the last
        handle of the imported tensor gone: its release is queued on the device)."""
        mgpu.waitall()
        _core._emu_producer_finish(self.gpu_index, self.stream)


@pytest.mark.skipif(not EMULATED, reason="the producer's stream is the emulator's (test hooks)")
@pytest.mark.parametrize("gpu_index", [0, 1])
def test_dlpack_import_waits_for_writes_still_queued_on_the_producers_stream(gpu_index):
    """mgpu's first kernel on an imported tensor sees the producer's last write, not its queued
    NaN steps or the memory's old zeros: the import fence orders the compute stream after the
    producer's stream, through the stream mgpu passed."""
    if gpu_index >= NUM_GPUS:
        pytest.skip(f"needs gpu({gpu_index})")
    rng = np.random.default_rng(40 + gpu_index)
    for trial in range(8):
        values = rng.standard_normal(4096).astype(np.float32)
        producer = _PendingProducer(values, gpu_index, steps=6)
        t = mgpu.from_dlpack(producer)
        assert producer.streams == [_core._dlpack_stream(gpu_index)]
        got = (t * 2).numpy()
        summed = float(t.sum().item())
        del t  # mgpu gives the memory back (the producer's deleter runs) before it goes
        producer.finish()
        np.testing.assert_array_equal(
            got, values * 2, err_msg=f"import {trial} on gpu({gpu_index}) ({SEED})")
        np.testing.assert_allclose(summed, values.astype(np.float64).sum(), rtol=1e-4, atol=1e-3,
                                   err_msg=f"import {trial} on gpu({gpu_index}) ({SEED})")


@pytest.mark.skipif(not EMULATED, reason="the producer's stream is the emulator's (test hooks)")
def test_dlpack_imports_of_two_producers_each_wait_for_their_own_writes():
    """Two producers with writes queued on their own streams, imported one after the other and
    used together in one kernel: each import's fence covers its own producer's work."""
    rng = np.random.default_rng(41)
    for trial in range(4):
        a = rng.standard_normal(2048).astype(np.float32)
        b = rng.standard_normal(2048).astype(np.float32)
        pa, pb = _PendingProducer(a, 0, steps=4), _PendingProducer(b, 0, steps=4)
        got = (mgpu.from_dlpack(pa) + mgpu.from_dlpack(pb)).numpy()
        pa.finish()
        pb.finish()
        np.testing.assert_array_equal(got, a + b, err_msg=f"imports {trial} ({SEED})")
