"""The trainer's durable state: its checkpoints, and the frozen reference model.

A checkpoint (`save`, crash-safe by keelrl.runs.save_checkpoint) holds the policy and its
tokenizer as a Hugging Face model folder, and in state.pt the step, the optimiser, the skipped
updates, the summary so far, torch's RNG state, and the critic, curriculum and process reward
model where the run has them. The reference model is written once, after the warm start and
before the step-0 checkpoint (`freeze_reference`), so any checkpoint a resume finds was made
after the reference was complete and durable.

A LoRA policy (`model.lora.rank` > 0) is saved as its adapter alone (peft's
adapter_model.safetensors and adapter_config.json, naming the base), never the base's weights:
model/ is then an adapter folder, which `load_policy` loads onto its base. Its optimiser state
is the adapter's, a critic with a frozen base (critic=separate) keeps its trainable weights
alone, and reference/ holds the reference's adapter (`keelrl.policy.lora.AdapterReference`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from keelrl.policy import lora
from keelrl.runs import REFERENCE, CheckpointError, latest_checkpoint, replace_folder, save_checkpoint

if TYPE_CHECKING:
    from keelrl.train.trainer import Trainer


def save(trainer: Trainer) -> Path:
    """Checkpoint `trainer`'s current step; -> its folder."""

    adapter = lora.is_lora(trainer.model)

    def write(folder: Path) -> None:
        if adapter:
            lora.save_adapter(trainer.model, folder / "model")
        else:
            trainer.model.save_pretrained(folder / "model")
        trainer.tokenizer.save_pretrained(folder / "model")
        parts = {"value_head": trainer.value_head, "curriculum": trainer.curriculum, "prm": trainer.prm}
        torch.save({"step": trainer.step, "optimizer": trainer.learner.optimizer.state_dict(),
                    "skipped_steps": trainer.skipped_steps, "summary": trainer.summary,
                    "torch_rng": torch.random.get_rng_state(),
                    **{name: _part_state(part, adapter) for name, part in parts.items()}},
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
    adapter = lora.is_lora(trainer.model)
    if adapter != lora.is_adapter_dir(path / "model"):
        holds = "a LoRA adapter" if lora.is_adapter_dir(path / "model") else "a whole model"
        raise CheckpointError(f"{path / 'model'} holds {holds}, but the run's model.lora.rank is "
                              f"{trainer.cfg.model.lora.rank}: resume with the model.lora the run was made with")
    if adapter:
        try:
            lora.load_adapter_weights(trainer.model, path / "model")
        except (ValueError, FileNotFoundError) as error:
            raise CheckpointError(f"cannot load the checkpoint's adapter: {error}") from None
    else:
        loaded = AutoModelForCausalLM.from_pretrained(path / "model", dtype=next(trainer.model.parameters()).dtype)
        trainer.model.load_state_dict(loaded.state_dict())
    for name in ("value_head", "curriculum", "prm"):
        part = getattr(trainer, name)
        if part is not None and state.get(name) is not None:
            if adapter and isinstance(part, torch.nn.Module):
                lora.load_trainable_state_dict(part, state[name])
            else:
                part.load_state_dict(state[name])
    trainer.learner.optimizer = trainer.learner.new_optimizer()
    trainer.learner.optimizer.load_state_dict(state["optimizer"])
    torch.random.set_rng_state(state["torch_rng"])
    trainer.step, trainer.skipped_steps, trainer.summary = state["step"], state["skipped_steps"], state["summary"]


def _part_state(part: Any, adapter: bool) -> Any:
    """What a checkpoint keeps of a part of the trainer (None where the run has none): its state
    dict; of a LoRA run's torch module, its trainable weights alone (a separate critic's base is
    model.path's, frozen)."""
    if part is None:
        return None
    if adapter and isinstance(part, torch.nn.Module):
        return lora.trainable_state_dict(part)
    return part.state_dict()


def freeze_reference(trainer: Trainer) -> None:
    """Make the reference a frozen copy of the current policy and save it (reference/) for resumes."""
    if trainer.reference is None:
        return
    if isinstance(trainer.reference, lora.AdapterReference):
        trainer.reference.freeze()
        replace_folder(trainer.run_dir, REFERENCE, trainer.reference.save)
        return
    trainer.reference.load_state_dict(trainer.model.state_dict())
    trainer.reference.eval().requires_grad_(False)
    replace_folder(trainer.run_dir, REFERENCE, trainer.reference.save_pretrained)


def load_reference(trainer: Trainer) -> None:
    """A resumed run's reference: the weights reference/ holds."""
    if trainer.reference is None:
        return
    if isinstance(trainer.reference, lora.AdapterReference):
        try:
            trainer.reference.load(trainer.run_dir / REFERENCE)
        except (ValueError, FileNotFoundError) as error:
            raise CheckpointError(f"cannot load the reference's adapter: {error}") from None
        return
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(trainer.run_dir / REFERENCE,
                                                 dtype=next(trainer.reference.parameters()).dtype)
    trainer.reference.load_state_dict(saved.state_dict())
    trainer.reference.eval().requires_grad_(False)
