"""The chapter's own multi-device code (sec. 12.5.4-12.5.6), nearly line for line, on mgpu.

This is the op-by-op version: Python loops over devices, autograd records each op, the naive
allreduce copies everything through device 0. mgpu's fused ``train_batch`` must compute the same
step; the tests run both and compare.
"""
from __future__ import annotations

from .autograd import no_grad
from .models import lenet
from .nn import CrossEntropyLoss
from .parallel import sgd, split_batch

loss = CrossEntropyLoss(reduction="none")


def allreduce(data):
    """Sums ``data`` (one tensor per device) into data[0], then copies it back everywhere."""
    for i in range(1, len(data)):
        data[0][:] += data[i].to(data[0].device)
    for i in range(1, len(data)):
        data[i][:] = data[0].to(data[i].device)


def train_batch(X, y, device_params, devices, lr):
    """One data-parallel step written op by op, as the chapter writes it."""
    X_shards, y_shards = split_batch(X, y, devices)
    # Loss is calculated separately on each device
    ls = [loss(lenet(X_shard, device_W), y_shard).sum()
          for X_shard, y_shard, device_W in zip(X_shards, y_shards, device_params)]
    for l in ls:  # Backpropagation is performed separately on each device
        l.backward()
    # Sum all gradients from each device and broadcast them to all devices
    with no_grad():
        for i in range(len(device_params[0])):
            allreduce([device_params[c][i].grad for c in range(len(devices))])
    # The model parameters are updated separately on each device
    for param in device_params:
        sgd(param, lr, X.shape[0])  # Here, we use a full-size batch
