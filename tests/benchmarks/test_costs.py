"""The cost model of a host store against recomputation (benchmarks/_costs.py)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _costs import offload_is_cheaper, offload_seconds, recompute_seconds  # noqa: E402

MiB = 2**20


def test_a_host_store_moves_each_byte_twice_and_recomputation_runs_the_flops_once():
    assert offload_seconds(25e9, bandwidth=50e9) == 1.0  # out in the forward, back in the backward
    assert recompute_seconds(150e12, throughput=75e12) == 2.0


def test_resnet50_under_bf16_recomputes_faster_than_the_link_moves_what_it_saves():
    # per image: 66 MiB saved for 8.2 GFLOP of forward
    assert offload_seconds(66 * MiB) == pytest.approx(2.77e-3, rel=0.01)
    assert recompute_seconds(8.2e9) == pytest.approx(0.109e-3, rel=0.01)
    assert not offload_is_cheaper(66 * MiB, 8.2e9)


def test_a_small_tensor_made_by_many_flops_is_cheaper_to_move():
    assert offload_is_cheaper(1 * MiB, 1e12)  # a large matmul's small output
    assert not offload_is_cheaper(1 * MiB, 1e12, bandwidth=1e6)  # over a slow link it is not


@pytest.mark.parametrize("call", [lambda: offload_seconds(1, bandwidth=0), lambda: offload_seconds(-1),
                                  lambda: recompute_seconds(1, throughput=-5.0), lambda: recompute_seconds(-1),
                                  lambda: offload_seconds(1, bandwidth=True)])
def test_rates_must_be_positive_and_amounts_not_negative(call):
    with pytest.raises(ValueError, match="must be"):
        call()
