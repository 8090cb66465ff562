"""The first ratio bar (issue: codec core) on 64 MiB tensors drawn fresh."""
import numpy as np
import pytest

import portable_zip as pz
from harness.tensors import BAR, exponent_entropy_bound, make_tensor


@pytest.mark.parametrize("name", sorted(BAR))
def test_ratio_bar(name):
    t = make_tensor(name, 64 << 20, np.random.default_rng())
    ratio = pz.inspect(pz.compress(t))["ratio"]
    bound = exponent_entropy_bound(t)
    assert bound <= ratio <= BAR[name], f"{name}: ratio {ratio:.4f} (bound {bound:.4f}, bar {BAR[name]})"
