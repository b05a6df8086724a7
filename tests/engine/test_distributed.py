"""Two ranks with gloo on CPU train exactly like one process with the whole batch.

The ranks are real processes started with torchrun's environment variables (RANK, WORLD_SIZE, ...);
their program is tests/programs/distributed_ranks.py.
"""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import GLOO_EXIT_ABORT, assert_ranks_ended_well, ce_loss, cpu_env, launch_ranks, rel_err
from models import ranks_batches, ranks_net, ranks_sgd
from programs.distributed_ranks import SCENARIOS

ROOT = Path(__file__).resolve().parents[2]
# Every test here runs ranks as processes that meet in gloo collectives, with timeouts against a hang.
pytestmark = pytest.mark.realtime
PROGRAM = ROOT / "tests" / "programs" / "distributed_ranks.py"



# ---------------------------------------------------------------- the tests
def launch(scenario: str, out: Path, pg_timeout_s: float = 300, wait_s: float = 900, wait_for=(0, 1)):
    """Start 2 ranks of tests/programs/distributed_ranks.py as torchrun would (see helpers.launch_ranks). The
    timeouts only guard against a hang: a rank that a loaded machine leaves behind is waited for."""
    return launch_ranks([str(PROGRAM), scenario, str(out)], out, wait_s=wait_s, wait_for=wait_for,
                        PG_TIMEOUT_S=str(pg_timeout_s))


@pytest.fixture(scope="module")
def exact_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("exact")
    results = launch("exact", out)
    assert_ranks_ended_well(results)
    return out


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_two_ranks_of_micro_batches_equal_one_process_with_the_whole_batch(exact_run, scenario):
    """Micro-batch 2 x 4 accumulation x 2 ranks against plain PyTorch on batches of 16 (and a short
    last batch of 11, split 6 + 5 over the ranks): parameters, running stats and losses."""
    model = ranks_net()  # torch's own BatchNorm: the oracle
    opt = ranks_sgd(model)
    oracle_losses = []
    for b in ranks_batches(SCENARIOS[scenario]):
        opt.zero_grad()
        loss = ce_loss(model, b)
        loss.backward()
        opt.step()
        oracle_losses.append(loss.item())
    ranks = [torch.load(exact_run / f"{scenario}-{r}.pt") for r in range(2)]
    for got in ranks:
        assert got["losses"] == pytest.approx(oracle_losses, rel=1e-5)
        for key, want in model.state_dict().items():
            if key.endswith("num_batches_tracked"):
                assert got["state"][key] == want, key
            else:
                assert rel_err(got["state"][key], want) < 1e-5, key
    for key, value in ranks[0]["state"].items():  # the ranks agree bit for bit
        assert torch.equal(value, ranks[1]["state"][key]), key


def test_a_checkpoint_resumes_every_rank_with_its_own_rng(exact_run):
    for rank in range(2):
        got = torch.load(exact_run / f"resume-{rank}.pt")
        (losses, state), (want_losses, want_state) = got["resumed"], got["straight"]
        assert losses == want_losses
        assert all(torch.equal(v, want_state[k]) for k, v in state.items())


def test_a_batch_too_small_for_the_world_is_a_clear_error(exact_run):
    for rank in range(2):
        message = (exact_run / f"shard-error-{rank}.txt").read_text()
        assert "1 samples leaves rank 1 of world size 2 with no samples" in message


@pytest.mark.parametrize("failure", ["raise", "stall"])
def test_a_failing_rank_stops_the_other_with_an_error(tmp_path, failure):
    """Rank 1 raises (its process exits) or stalls (alive, out of the collectives) at step 3: rank 0
    must end with an error instead of hanging: at once when rank 1's process is gone, within the process group's
    timeout (5 s, which only the stall is given) when it is alive but gone from the collectives."""
    # a stalled rank 1 never ends by itself: wait for rank 0 alone, then kill it
    if failure == "raise":
        results = launch(failure, tmp_path)
    else:
        results = launch(failure, tmp_path, pg_timeout_s=5, wait_for=(0,))
    rc0, log0 = results[0]
    assert rc0 != 0, log0
    assert not (tmp_path / "finished-0").exists()
    if failure == "raise":
        rc1, log1 = results[1]
        assert rc1 != 0 and "rank 1 fails at step 3" in log1
    else:
        assert "Timed out waiting 5000ms" in log0, log0[-2000:]  # gloo's collective timeout, not a crash


def test_example_runs_under_torchrun_like_one_process(tmp_path):
    """examples/ddp.py on 2 ranks logs the same losses as the same script in one process."""
    common = [str(ROOT / "examples" / "ddp.py"), "--steps", "3", "--batch-size", "16", "--micro-batch-size", "4",
              "--eval-every", "3"]
    env = cpu_env()
    runs = {"torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"],
            "single": [sys.executable]}
    losses = {}
    for name, launcher in runs.items():
        out = tmp_path / name
        proc = subprocess.run(launcher + common + ["--out", str(out)], cwd=ROOT, env=env, timeout=900,
                              capture_output=True, text=True)
        # torchrun reports a rank that gloo aborted at exit (see helpers.GLOO_EXIT_ABORT) as a failure of its own
        aborted_at_exit = GLOO_EXIT_ABORT in proc.stderr and "exitcode: -6" in proc.stderr
        assert proc.returncode == 0 or (name == "torchrun" and aborted_at_exit), proc.stdout + proc.stderr
        assert "step 3: loss" in proc.stdout and "val_acc" in proc.stdout, proc.stdout
        rows = (out / "metrics.csv").read_text().splitlines()[1:]
        losses[name] = [float(r.split(",")[2]) for r in rows if r.split(",")[1] == "loss"]
    assert len(losses["torchrun"]) == 3
    assert losses["torchrun"] == pytest.approx(losses["single"], rel=1e-5)
