"""One process of a two-process mmengine run on CPU (gloo), started by tests/integrations/test_mmengine.py.

    torchrun --nproc_per_node 2 tests/programs/mmengine_ddp.py OUT CLIP

launcher="pytorch": the Runner wraps the model in MMDistributedDataParallel and DefaultSampler gives each process
its share. 3 iterations over global batches of 8, split 4 + 4 over the processes, each process's 4 as micro-batches
3 + 1, in float64, the gradient clipped to norm CLIP; torch's BatchNorm layers as they are. The batches this process
was given and the final state of the net go to OUT/rank<rank>.pt.
"""
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from mmengine.hooks import Hook
from mmengine.runner import Runner

import accumnorm.integrations.mmengine  # noqa: F401
from models import mm_classifier, mm_samples, tiny_bn, tiny_dataset


class Recording(Hook):
    """Keeps the batch of every iteration: this process's part of the global batch."""

    def __init__(self) -> None:
        self.batches = []

    def before_train_iter(self, runner, batch_idx, data_batch=None) -> None:
        self.batches.append((data_batch["inputs"], torch.stack([s.gt_label for s in data_batch["data_samples"]])))


def main(out: Path, clip: float) -> None:
    # mmengine's own set-up selects a CUDA device first: on CPU the group is made here, and the Runner keeps it
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    net = tiny_bn()
    recording = Recording()
    runner = Runner(
        model=mm_classifier()(net), work_dir=str(out / "run"), launcher="pytorch",
        cfg=dict(model_wrapper_cfg=dict(type="MMDistributedDataParallel", device_ids=None)),  # a CPU module
        train_dataloader=dict(dataset=mm_samples(tiny_dataset(24)), sampler=dict(type="DefaultSampler", shuffle=False),
                              batch_size=4, collate_fn=dict(type="default_collate"), num_workers=0),
        train_cfg=dict(type="ExactIterBasedTrainLoop", micro_batch_size=3, max_iters=3),
        optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.2, momentum=0.9), clip_grad=dict(max_norm=clip)),
        param_scheduler=dict(type="StepLR", step_size=1, gamma=0.5, by_epoch=False),
        default_hooks=dict(checkpoint=None), custom_hooks=[recording], log_level="WARNING")
    runner.train()
    assert isinstance(runner.model, torch.nn.parallel.DistributedDataParallel), type(runner.model)
    torch.save({"state": net.state_dict(), "batches": recording.batches}, out / f"rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), float(sys.argv[2]))
