"""One "finite number >= 0" rule (tensor.check_nonnegative) for the hyperparameters wherever they
enter: an optimizer's groups and the fused model's train_step accept and refuse the same values
with the same words."""
from fractions import Fraction

import numpy as np
import pytest

import mgpu
from mgpu import parallel
from mgpu.tensor import check_nonnegative

C0, C1 = mgpu.cpu(0), mgpu.cpu(1)


@pytest.mark.parametrize("v,want", [(0, 0.0), (0.0, 0.0), (3, 3.0), (np.float32(0.5), 0.5),
                                    (np.int64(2), 2.0), (Fraction(1, 4), 0.25), (1e300, 1e300)])
def test_a_finite_number_at_least_zero_is_taken_as_a_float(v, want):
    got = check_nonnegative(v, "op", "lr")
    assert type(got) is float and got == want


NOT_NUMBERS = [True, "0.1", None, [0.1], complex(1, 0), np.complex128(1)]
BAD_VALUES = [-1, -0.5, -1e-300, float("nan"), float("inf"), float("-inf"), np.float32("nan"),
              10 ** 400]


def _id(v):
    return repr(v)[:16]


@pytest.mark.parametrize("v", NOT_NUMBERS, ids=_id)
def test_what_is_not_a_real_number_is_a_type_error(v):
    with pytest.raises(TypeError, match=rf"^op: lr must be a number, got {type(v).__name__}$"):
        check_nonnegative(v, "op", "lr")


@pytest.mark.parametrize("v", BAD_VALUES, ids=_id)
def test_a_negative_or_non_finite_number_is_a_value_error(v):
    with pytest.raises(ValueError) as e:
        check_nonnegative(v, "op", "lr")
    assert str(e.value) == f"op: lr must be a finite number >= 0.0, got {v}"


def _fused_lr_error(v):
    rng = np.random.default_rng(0)
    spec = [("flatten",), ("linear", {"transpose": True})]
    arrays = [rng.standard_normal(s).astype(np.float32) for s in [(3, 4), (3,)]]
    replicas = [[mgpu.array(a, device=d) for a in arrays] for d in (C0, C1)]
    model = parallel.FusedModel(spec, replicas, [[], []], [C0, C1])
    X = mgpu.array(rng.random((4, 1, 2, 2), dtype=np.float32))
    with pytest.raises((TypeError, ValueError)) as e:
        model.train_step(X, mgpu.array(np.array([0, 1, 2, 1])), v)
    return e


def _optimizer_lr_error(v):
    with pytest.raises((TypeError, ValueError)) as e:
        mgpu.optim.SGD([mgpu.nn.Parameter(mgpu.zeros((2,)))], lr=v)
    return e


@pytest.mark.parametrize("v", NOT_NUMBERS + BAD_VALUES, ids=_id)
def test_the_optimizer_and_the_fused_step_say_the_same(v):
    fused, book = _fused_lr_error(v), _optimizer_lr_error(v)
    assert fused.type is book.type
    tail = str(fused.value).split(": lr must", 1)[1]
    assert str(fused.value).startswith("train_step: lr must")
    assert str(book.value).endswith(": lr must" + tail)
