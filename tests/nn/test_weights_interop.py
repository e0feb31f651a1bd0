"""Weights by name (Module.load_state_dict with PyTorch's rules) and safetensors files both ways:
any safetensors file read by mgpu.load, mgpu's files read by the `safetensors` package from PyPI
(its NumPy API; .ci/setup.sh installs it). The PyTorch side is in test_torch_interop.py."""
import json
import struct

import numpy as np
import pytest

import mgpu
from mgpu import nn
from mgpu.models import resnet18


def _small_net():
    net = nn.Sequential(nn.Conv2d(1, 4, kernel_size=3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                        nn.Flatten(), nn.Linear(4 * 5 * 5, 3))
    return net


def _random_state(net, seed):
    """NumPy values of every entry of ``net``'s state dict, distinct from its current ones."""
    rng = np.random.default_rng(seed)
    out = {}
    for k, v in net.state_dict().items():
        if v.dtype == np.int64:
            out[k] = np.array(rng.integers(1, 100), dtype=np.int64).reshape(v.shape)
        else:
            out[k] = rng.standard_normal(v.shape).astype(np.float32)
    return out


def _values(net):
    return {k: v.numpy().copy() for k, v in net.state_dict().items()}


class DLPackOnly:
    """An object that offers nothing but the DLPack protocol (as a PyTorch tensor does)."""

    def __init__(self, a):
        self._a = a
        self.shape = a.shape

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_dataparallel_prefix_is_dropped_and_values_land_by_name():
    net = _small_net()
    state = _random_state(net, 0)
    got = net.load_state_dict({"module." + k: v for k, v in state.items()})
    assert got.missing_keys == [] and got.unexpected_keys == []
    for k, v in _values(net).items():
        assert np.array_equal(v, state[k]), k


def test_a_prefix_the_module_itself_has_is_kept():
    outer = nn.Sequential()
    outer.add_module("module", _small_net())
    state = _random_state(outer, 1)
    assert all(k.startswith("module.") for k in state)
    outer.load_state_dict(state)
    for k, v in _values(outer).items():
        assert np.array_equal(v, state[k]), k


def test_dlpack_values_load_contiguous_strided_and_converted():
    net = _small_net()
    state = _random_state(net, 2)
    given = {}
    for k, v in state.items():
        if k.endswith("weight") and v.ndim == 2:  # a strided view: the transpose of a copy
            given[k] = DLPackOnly(np.ascontiguousarray(v.T).T)
        elif k.endswith("bias"):  # float64: converted to the parameter's float32
            given[k] = DLPackOnly(v.astype(np.float64))
        else:
            given[k] = DLPackOnly(v)
    net.load_state_dict(given)
    for k, v in _values(net).items():
        assert np.array_equal(v, state[k]), k


def test_strict_reports_missing_and_unexpected_keys_as_pytorch_and_changes_nothing():
    net = _small_net()
    before = _values(net)
    state = _random_state(net, 3)
    state.pop("4.bias")
    state["4.extra"] = np.zeros(2, np.float32)
    with pytest.raises(ValueError, match=r'Missing key\(s\) in state_dict: "4.bias".*Unexpected '
                       r'key\(s\) in state_dict: "4.extra"'):
        net.load_state_dict(state)
    for k, v in _values(net).items():
        assert np.array_equal(v, before[k]), k
    got = net.load_state_dict(state, strict=False)
    assert got.missing_keys == ["4.bias"] and got.unexpected_keys == ["4.extra"]
    after = _values(net)
    assert np.array_equal(after["4.bias"], before["4.bias"])
    assert np.array_equal(after["4.weight"], state["4.weight"])


def test_a_shape_mismatch_names_key_and_shapes_and_changes_nothing_even_when_not_strict():
    net = _small_net()
    before = _values(net)
    state = _random_state(net, 4)
    state["0.weight"] = np.zeros((4, 1, 5, 5), np.float32)
    for strict in (True, False):
        with pytest.raises(ValueError, match=r"size mismatch for 0.weight: copying a param with "
                           r"shape \(4, 1, 5, 5\) from checkpoint, the shape in current model is "
                           r"\(4, 1, 3, 3\)"):
            net.load_state_dict(state, strict=strict)
        for k, v in _values(net).items():
            assert np.array_equal(v, before[k]), k


def test_a_value_of_no_tensor_kind_is_a_type_error_naming_the_key():
    net = _small_net()
    state = _random_state(net, 5)
    state["1.weight"] = [1.0, 2.0, 3.0, 4.0]
    with pytest.raises(TypeError, match="entry '1.weight' is a list"):
        net.load_state_dict(state)


def test_batchnorm_count_may_be_absent_as_in_older_pytorch_files():
    net = _small_net()
    state = _random_state(net, 6)
    state.pop("1.num_batches_tracked")
    got = net.load_state_dict(state)
    assert got.missing_keys == []
    assert int(net.state_dict()["1.num_batches_tracked"].item()) == 0


# --- safetensors ------------------------------------------------------------------------------

def _write_safetensors(path, entries, meta=None):
    """A safetensors file written by hand: entries are (name, dtype code, shape, raw bytes)."""
    header, offset, blobs = {}, 0, []
    if meta is not None:
        header["__metadata__"] = meta
    for name, code, shape, raw in entries:
        header[name] = {"dtype": code, "shape": list(shape),
                        "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def test_any_safetensors_file_loads_by_name_with_lossless_conversions(tmp_path):
    st = pytest.importorskip("safetensors.numpy", reason="pip install safetensors "
                             "(.ci/setup.sh installs it)")
    rng = np.random.default_rng(7)
    arrays = {
        "f32": rng.standard_normal((3, 4)).astype(np.float32),
        "f16": rng.standard_normal((5,)).astype(np.float16),
        "i8": np.array([-128, 0, 127], np.int8), "i16": np.array([-32768, 32767], np.int16),
        "u16": np.array([0, 65535], np.uint16), "u32": np.array([0, 2**32 - 1], np.uint32),
        "i32": np.array([-(2**31), 2**31 - 1], np.int32), "i64": np.array([2**40, -3], np.int64),
        "u8": np.arange(6, dtype=np.uint8).reshape(2, 3), "bool": np.array([True, False, True]),
        "scalar": np.array(2.5, np.float32), "empty": np.zeros((0, 3), np.float32),
    }
    path = tmp_path / "hf.safetensors"
    st.save_file(arrays, str(path), metadata={"format": "np"})
    got = mgpu.load(path)
    assert sorted(got) == sorted(arrays)
    held = {"f32": np.float32, "f16": np.float32, "i8": np.int32, "i16": np.int32,
            "u16": np.int32, "u32": np.int64, "i32": np.int32, "i64": np.int64, "u8": np.uint8,
            "bool": np.uint8, "scalar": np.float32, "empty": np.float32}
    for k, a in arrays.items():
        assert isinstance(got[k], mgpu.Tensor) and got[k].dtype == held[k], k
        assert got[k].shape == a.shape, k
        assert np.array_equal(got[k].numpy(), a.astype(held[k])), k


def test_bfloat16_loads_as_bfloat16_and_widens_to_the_float32_it_encodes(tmp_path):
    # bfloat16 bits written by hand: the top 16 bits of float32 values that bfloat16 holds.
    values = np.array([1.0, -2.5, 3.140625, 0.0, -0.0, np.inf, 2.0**-126, -(2.0**-133)],
                      np.float32)  # the last two: the smallest normal, a subnormal
    bits = (values.view(np.uint32) >> 16).astype("<u2")
    assert np.array_equal((bits.astype(np.uint32) << 16).view(np.float32), values)  # exact
    path = tmp_path / "bf16.safetensors"
    _write_safetensors(path, [("w", "BF16", values.shape, bits.tobytes())])
    got = mgpu.load(path)["w"]
    assert got.dtype == mgpu.bfloat16 and np.array_equal(got.bits(), bits)
    wide = got.astype(mgpu.float32).numpy()
    assert np.array_equal(wide.view(np.uint32), values.view(np.uint32))


def test_lossy_dtypes_and_broken_files_are_refused_by_name(tmp_path):
    p = tmp_path / "f64.safetensors"
    _write_safetensors(p, [("ok", "F32", (1,), b"\0" * 4), ("w", "F64", (2,), b"\0" * 16)])
    with pytest.raises(mgpu.CheckpointError, match=r"tensor 'w' is F64 \(float64\)"):
        mgpu.load(p)
    p = tmp_path / "gap.safetensors"
    _write_safetensors(p, [("a", "F32", (1,), b"\0" * 4)])
    data = bytearray(p.read_bytes()) + b"\0" * 4  # 4 bytes no tensor covers
    p.write_bytes(bytes(data))
    with pytest.raises(mgpu.CheckpointError, match="describes 4 bytes of tensor data but 8"):
        mgpu.load(p)
    header = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}).encode()
    p.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    with pytest.raises(mgpu.CheckpointError, match="span 4 bytes but F32 of shape"):
        mgpu.load(p)
    header = json.dumps({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
                         "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}).encode()
    p.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    with pytest.raises(mgpu.CheckpointError, match="starts at byte 4 of the data, expected 0"):
        mgpu.load(p)


def test_mgpu_files_are_read_by_the_safetensors_package(tmp_path):
    st = pytest.importorskip("safetensors.numpy", reason="pip install safetensors "
                             "(.ci/setup.sh installs it)")
    from safetensors import safe_open
    net = resnet18(10)
    net.load_state_dict(_random_state(net, 8))
    path = tmp_path / "net.mgpu"
    mgpu.save(net.state_dict(), path)
    theirs = st.load_file(str(path))
    ours = _values(net)
    assert list(theirs) != [] and sorted(theirs) == sorted(ours)
    for k, v in ours.items():
        assert theirs[k].dtype == v.dtype and np.array_equal(theirs[k], v), k
    with safe_open(str(path), framework="np") as f:
        assert f.metadata()["format"] == "mgpu.checkpoint"
    # And back: the package's file of those arrays loads into a fresh network by name.
    again = tmp_path / "net.safetensors"
    st.save_file(theirs, str(again))
    fresh = resnet18(10)
    fresh.load_state_dict(mgpu.load(again))
    for k, v in _values(fresh).items():
        assert np.array_equal(v, ours[k]), k
