"""accumnorm.distributed.shard without a process group: one rank, which gets the whole batch in the batch's own form."""
from collections import namedtuple

import pytest
import torch

from accumnorm import distributed

Batch = namedtuple("Batch", ["x", "y"])


@pytest.mark.parametrize("form", ["tensor", "tuple", "list", "dict", "namedtuple"])
def test_one_rank_gets_the_whole_batch_in_its_own_form(form):
    """A namedtuple, which its type builds from its fields one by one, raised a TypeError."""
    x, y = torch.randn(5, 3), torch.arange(5)
    batch = {"tensor": x, "tuple": (x, y), "list": [x, y], "dict": {"x": x, "y": y}, "namedtuple": Batch(x, y)}[form]
    mine = distributed.shard(batch)
    assert type(mine) is type(batch)
    if form == "tensor":
        assert torch.equal(mine, x)
    else:
        values = mine.values() if form == "dict" else mine
        assert all(torch.equal(a, b) for a, b in zip(values, (x, y), strict=True))
