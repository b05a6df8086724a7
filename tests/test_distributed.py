"""Two ranks with gloo on CPU train exactly like one process with the whole batch.

The ranks are real processes started from torchrun's environment variables; this file is also
their program (``python tests/test_distributed.py SCENARIO OUT`` with RANK, WORLD_SIZE, ...).
"""
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import accumnorm
from accumnorm import Trainer, distributed
from helpers import ce_loss, cpu_env, launch_ranks, rel_err

ROOT = Path(__file__).resolve().parents[1]
MICRO = 2  # micro-batch 2 x 4 accumulation x 2 ranks = one batch of 16
SCENARIOS = {"even": [16, 16, 16, 16], "uneven": [16, 16, 11], "ddp_wrapped": [16, 16, 16]}


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def batches(sizes):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 4, (n,), generator=g)) for n in sizes]


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


# ---------------------------------------------------------------- the ranks' program
def worker(scenario: str, out: Path) -> None:
    env = distributed.init_from_env(timeout=timedelta(seconds=float(os.environ["PG_TIMEOUT_S"])))
    if scenario == "exact":
        for name, sizes in SCENARIOS.items():
            model = accumnorm.convert(net())
            if name == "ddp_wrapped":
                model = nn.parallel.DistributedDataParallel(model)
            trainer = Trainer(model, sgd(model), ce_loss, micro_batch_size=MICRO)
            losses = [trainer.step(distributed.shard(b)) for b in batches(sizes)]
            torch.save({"losses": losses, "state": trainer.model.state_dict()}, out / f"{name}-{env.rank}.pt")
        resume(env.rank, out)
        try:
            distributed.shard(torch.zeros(1, 3))
        except ValueError as e:
            (out / f"shard-error-{env.rank}.txt").write_text(str(e))
    elif scenario in ("raise", "stall"):
        model = accumnorm.convert(net())
        trainer = Trainer(model, sgd(model), ce_loss, micro_batch_size=MICRO)

        def failing_loss(model, batch):
            if env.rank == 1 and trainer.step_count == 2:
                if scenario == "stall":  # alive, but never joins the step's collectives again
                    time.sleep(600)
                raise RuntimeError("rank 1 fails at step 3")
            return ce_loss(model, batch)

        trainer.loss_fn = failing_loss
        for b in batches([16] * 5):
            trainer.step(distributed.shard(b))
        (out / f"finished-{env.rank}").touch()
    torch.distributed.destroy_process_group()


def resume(rank: int, out: Path) -> None:
    """2 steps, save, 2 more; against a fresh trainer loaded from the checkpoint, 2 more. Each rank
    draws its own dropout masks, so each must get its own RNG state back."""
    def dropout_net() -> nn.Module:
        return accumnorm.convert(nn.Sequential(net(), nn.Dropout(0.5)))

    model = dropout_net()
    trainer = Trainer(model, sgd(model), ce_loss, micro_batch_size=MICRO)
    torch.manual_seed(100 + rank)
    data = [distributed.shard(b) for b in batches([16] * 4)]
    for b in data[:2]:
        trainer.step(b)
    trainer.save(out / "checkpoint.pt")
    straight = [trainer.step(b) for b in data[2:]], model.state_dict()
    model = dropout_net()
    torch.manual_seed(7)  # whatever the RNG holds now, the checkpoint's comes back
    trainer = Trainer.load(out / "checkpoint.pt", model, sgd(model), ce_loss)
    resumed = [trainer.step(b) for b in data[2:]], model.state_dict()
    torch.save({"straight": straight, "resumed": resumed}, out / f"resume-{rank}.pt")


# ---------------------------------------------------------------- the tests
def launch(scenario: str, out: Path, pg_timeout_s: float = 30, wait_s: float = 90, wait_for=(0, 1)):
    """Start 2 ranks of this file's program as torchrun would (see helpers.launch_ranks)."""
    return launch_ranks([__file__, scenario, str(out)], out, wait_s=wait_s, wait_for=wait_for,
                        PG_TIMEOUT_S=str(pg_timeout_s))


@pytest.fixture(scope="module")
def exact_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("exact")
    results = launch("exact", out)
    assert [rc for rc, _ in results] == [0, 0], results
    return out


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_two_ranks_of_micro_batches_equal_one_process_with_the_whole_batch(exact_run, scenario):
    """Micro-batch 2 x 4 accumulation x 2 ranks against plain PyTorch on batches of 16 (and a short
    last batch of 11, split 6 + 5 over the ranks): parameters, running stats and losses."""
    model = net()  # torch's own BatchNorm: the oracle
    opt = sgd(model)
    oracle_losses = []
    for b in batches(SCENARIOS[scenario]):
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
    must end with an error, within the process group's 5 s timeout, instead of hanging."""
    # a stalled rank 1 never ends by itself: wait for rank 0 alone, then kill it
    results = launch(failure, tmp_path, pg_timeout_s=5, wait_s=60, wait_for=(0, 1) if failure == "raise" else (0,))
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
        proc = subprocess.run(launcher + common + ["--out", str(out)], cwd=ROOT, env=env, timeout=120,
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "step 3: loss" in proc.stdout and "val_acc" in proc.stdout, proc.stdout
        rows = (out / "metrics.csv").read_text().splitlines()[1:]
        losses[name] = [float(r.split(",")[2]) for r in rows if r.split(",")[1] == "loss"]
    assert len(losses["torchrun"]) == 3
    assert losses["torchrun"] == pytest.approx(losses["single"], rel=1e-5)


if __name__ == "__main__":
    worker(sys.argv[1], Path(sys.argv[2]))
