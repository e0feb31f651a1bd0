"""Fused or unfused is decided once, as the fused step's model is built, and recorded per layer
(Model.fusions): on CPU replicas a conv2d_relu_pool layer runs its one kernel (in bf16 on
bfloat16-rounded operands, where float32's rule runs the conv) and batch norm merges with the
relu (and add) after it; on GPUs every layer runs its ops one by one (the fused kernels are CPU
kernels, which refuse a GPU)."""
import numpy as np
import pytest

import mgpu
from mgpu import _core, nn
from mgpu.parallel import FusedModel
from test_data_parallel import batch, tiny_net

LENET_SPEC = [("conv2d_relu_pool", {"pool": 2}), ("flatten",), ("linear", {"transpose": True})]
LENET_SHAPES = [(2, 1, 3, 3), (2,), (3, 2 * 3 * 3), (3,)]


def _lenet_like(devices, bf16=False):
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in LENET_SHAPES]
    spec = [(k, dict(o, bf16=True) if bf16 and k == "conv2d_relu_pool" else o)
            for k, *rest in LENET_SPEC for o in [rest[0] if rest else {}]]
    return FusedModel(spec, [[mgpu.array(a, device=d) for a in arrays] for d in devices],
                      [[] for _ in devices], devices)


def _fusions_of_tiny_net(devices):
    model = nn.DataParallel(tiny_net(), device_ids=devices)
    Xn, yn = batch(7)
    model.train_step(mgpu.array(Xn, device=devices[0]), mgpu.array(yn, device=devices[0]),
                     nn.CrossEntropyLoss(), mgpu.optim.SGD(model.parameters(), lr=0.1))
    return model._fused.model._model.fusions()


def test_cpu_replicas_record_the_fused_kernels():
    cpus = [mgpu.cpu(0), mgpu.cpu(1)]
    assert _lenet_like(cpus)._model.fusions() == [("layer 0 (conv2d_relu_pool)",
                                                   "conv2d_relu_pool")]
    assert _lenet_like(cpus, bf16=True)._model.fusions() == [
        ("layer 0 (conv2d_relu_pool)", "conv2d_relu_pool on bfloat16-rounded operands where "
         "float32's rule runs the conv, else conv2d, relu, avg_pool2d")]
    kinds = [how for _, how in _fusions_of_tiny_net(cpus)]
    assert kinds == ["batch_norm_relu", "batch_norm_relu", "batch_norm_add_relu"]


@pytest.mark.gpu
def test_gpu_replicas_run_every_layer_unfused():
    if mgpu.num_gpus() < 1:
        pytest.skip("needs a GPU (the emulated build)")
    gpus = [mgpu.gpu(0)]
    assert _lenet_like(gpus)._model.fusions() == [("layer 0 (conv2d_relu_pool)",
                                                   "conv2d, relu, avg_pool2d")]
    assert _fusions_of_tiny_net(gpus) == []
    x = mgpu.array(np.ones((2, 3, 2, 2), np.float32), device=gpus[0])
    stats = mgpu.array(np.ones(3, np.float32), device=gpus[0])
    with pytest.raises(ValueError, match="batch_norm_act_forward: CPU devices only"):
        _core.batch_norm_act_forward(x._t, stats._t, stats._t, None, None, None, 1e-5)
