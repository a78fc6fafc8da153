"""The trainer's durable state: its checkpoints, and the frozen reference model.

A checkpoint (`save`, crash-safe by keelrl.runs.save_checkpoint) holds the policy and its
tokenizer as a Hugging Face model folder, and in state.pt the step, the optimiser, the skipped
updates, the summary so far, torch's RNG state, and the critic, curriculum and process reward
model where the run has them. The reference model is written once, after the warm start and
before the step-0 checkpoint (`freeze_reference`), so any checkpoint a resume finds was made
after the reference was complete and durable.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from keelrl.runs import REFERENCE, CheckpointError, latest_checkpoint, replace_folder, save_checkpoint

if TYPE_CHECKING:
    from keelrl.train.trainer import Trainer


def save(trainer: Trainer) -> Path:
    """Checkpoint `trainer`'s current step; -> its folder."""

    def write(folder: Path) -> None:
        trainer.model.save_pretrained(folder / "model")
        trainer.tokenizer.save_pretrained(folder / "model")
        parts = {"value_head": trainer.value_head, "curriculum": trainer.curriculum, "prm": trainer.prm}
        torch.save({"step": trainer.step, "optimizer": trainer.learner.optimizer.state_dict(),
                    "skipped_steps": trainer.skipped_steps, "summary": trainer.summary,
                    "torch_rng": torch.random.get_rng_state(),
                    **{name: part.state_dict() if part is not None else None for name, part in parts.items()}},
                   folder / "state.pt")

    return save_checkpoint(trainer.run_dir, trainer.step, write)


def load(trainer: Trainer) -> None:
    """Load the checkpoint run_dir/checkpoint.json names into `trainer`; CheckpointError when there is none."""
    from transformers import AutoModelForCausalLM

    path = latest_checkpoint(trainer.run_dir)
    if path is None:
        raise CheckpointError(f"nothing to resume in {trainer.run_dir}: no checkpoint.json (a run writes its "
                              f"first checkpoint at step 0, after the warm start and its evaluation; one "
                              f"killed before that must start again, without --resume)")
    state = torch.load(path / "state.pt", map_location=trainer.device, weights_only=False)
    loaded = AutoModelForCausalLM.from_pretrained(path / "model", dtype=next(trainer.model.parameters()).dtype)
    trainer.model.load_state_dict(loaded.state_dict())
    for name in ("value_head", "curriculum", "prm"):
        part = getattr(trainer, name)
        if part is not None and state.get(name) is not None:
            part.load_state_dict(state[name])
    trainer.learner.optimizer = trainer.learner.new_optimizer()
    trainer.learner.optimizer.load_state_dict(state["optimizer"])
    torch.random.set_rng_state(state["torch_rng"])
    trainer.step, trainer.skipped_steps, trainer.summary = state["step"], state["skipped_steps"], state["summary"]


def freeze_reference(trainer: Trainer) -> None:
    """Make the reference a frozen copy of the current policy and save it (reference/) for resumes."""
    if trainer.reference is None:
        return
    trainer.reference.load_state_dict(trainer.model.state_dict())
    trainer.reference.eval().requires_grad_(False)
    replace_folder(trainer.run_dir, REFERENCE, trainer.reference.save_pretrained)


def load_reference(trainer: Trainer) -> None:
    """A resumed run's reference: the weights reference/ holds."""
    if trainer.reference is None:
        return
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(trainer.run_dir / REFERENCE,
                                                 dtype=next(trainer.reference.parameters()).dtype)
    trainer.reference.load_state_dict(saved.state_dict())
    trainer.reference.eval().requires_grad_(False)
