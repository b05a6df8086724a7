"""One process of a two-process Hugging Face Trainer run on CPU (gloo), started by tests/integrations.

    torchrun --nproc_per_node 2 tests/programs/transformers_ddp.py OUT CLIP

3 optimizer steps of ExactTrainer, per process micro-batches of 3, 2 per step (global batches of 12), in
float64, the gradient clipped to norm CLIP, torch's BatchNorm layers as they are. The batches this process
trained on (each step's micro-batches joined) and the final state of the net go to OUT/rank<rank>.pt.
"""
import sys
from pathlib import Path

import torch
from transformers import TrainingArguments

from accumnorm.integrations.transformers import ExactTrainer
from helpers import sgd_halving
from models import KeywordClassifier, keyword_samples, tiny_bn, tiny_dataset


class Recording(ExactTrainer):
    """Keeps the micro-batches of every step, joined: the part of the global batch this process trains on."""

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self.seen.append(tuple(torch.cat([b[key] for b in batches]) for key in ("pixel_values", "labels")))
        return batches, num_items


def main(out: Path, clip: float) -> None:
    net = tiny_bn()
    optimizer, scheduler = sgd_halving(net.parameters())
    args = TrainingArguments(str(out / "run"), use_cpu=True, per_device_train_batch_size=3,
                             gradient_accumulation_steps=2, max_steps=3, max_grad_norm=clip, report_to="none",
                             save_strategy="no", disable_tqdm=True, ddp_backend="gloo")
    trainer = Recording(model=KeywordClassifier(net), args=args, train_dataset=keyword_samples(tiny_dataset(24)),
                        optimizers=(optimizer, scheduler))
    trainer.seen = []
    trainer.train()
    assert trainer.accelerator.num_processes == 2, trainer.accelerator.num_processes
    torch.save({"state": net.state_dict(), "batches": trainer.seen}, out / f"rank{trainer.args.process_index}.pt")
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main(Path(sys.argv[1]), float(sys.argv[2]))
