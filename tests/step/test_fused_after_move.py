"""The fused step after the user's module moved away and back (``net.to(other); net.to(home)``):
the move gives every parameter and buffer new memory, so the fused Model built before on the
old memory must not be reused -- a step on it would train the old copies while the user's
module never changes. After the move the step must leave the user's module where a network that
never moved stands after the same steps: bitwise (the same computation), with momentum carried
over."""
import numpy as np
import pytest

import mgpu
from mgpu import nn
from test_data_parallel import LR, batch, tiny_net


def _gpus():
    if mgpu.num_gpus() < 2:
        pytest.skip("needs 2 GPUs (the emulated build)")
    return [mgpu.gpu(0), mgpu.gpu(1)], mgpu.cpu(0)


def _cpus():
    return [mgpu.cpu(0), mgpu.cpu(1)], mgpu.cpu(1)


@pytest.mark.parametrize("where", [
    pytest.param(_cpus, id="cpu"),
    pytest.param(_gpus, id="gpu", marks=pytest.mark.gpu),
])
@pytest.mark.parametrize("sync", [False, True])
def test_fused_step_after_moving_the_module_away_and_back_trains_the_module(where, sync):
    devices, away = where()
    nets = [tiny_net(sync=sync), tiny_net(sync=sync)]  # the same weights
    moved, still = nets
    models = [nn.DataParallel(n, device_ids=devices) for n in nets]
    trainers = [mgpu.optim.SGD(m.parameters(), lr=LR, momentum=0.9) for m in models]
    loss = nn.CrossEntropyLoss()

    def step(seed):
        X, y = batch(8, seed=seed)
        for m, t in zip(models, trainers):
            m.train_step(mgpu.array(X, device=devices[0]), mgpu.array(y, device=devices[0]),
                         loss, t)

    step(0)  # builds both fused Models
    before = {k: v.numpy().copy() for k, v in moved.state_dict().items()}
    moved.to(away)
    moved.to(devices[0])
    for k, v in moved.state_dict().items():  # the move itself changes no value
        np.testing.assert_array_equal(v.numpy(), before[k], err_msg=f"{k} after the move")
    step(1)
    step(2)
    for (k, a), b in zip(moved.state_dict().items(), still.state_dict().values()):
        if k.endswith("num_batches_tracked"):
            continue
        assert a.device == devices[0], k
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=f"{k} after the move")
        if not k.endswith(("running_mean", "running_var")):
            assert not np.array_equal(a.numpy(), before[k]), f"{k}: the steps did not train it"
