"""The trainer's teacher: scores the student's rollouts for distillation (`distill.*`).

Two teachers, one interface:

- on_policy: a second causal LM (`distill.teacher`), loaded once, frozen, with the student's
  vocabulary (checked at load: a different tokenizer would score different tokens). It reads
  exactly the student's token ids.
- self (OPSD): the student itself, under no_grad, shown privileged context the rollout did not
  have: the task's reference fix, placed before the task in the first user message. Its input
  is that privileged prompt followed by everything the episode added after the original prompt
  (actions and observations, token for token), so each action token is scored at a shifted
  position; `TeacherView` keeps the map back to the student's layout.

Either way the teacher scores the tokens the student sampled (on-policy distillation: the
student's own histories, no exposure bias). `Teacher.logprobs` gives log pi_T of each sampled
token in the student's layout (for the sampled reverse KL, the dense advantage term);
`Teacher.action_logits` gives the teacher's full next-token logits at a micro-batch's action
tokens (for the divergence losses).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from keelrl.config import DistillConfig
from keelrl.policy.model import load_policy, output_logits
from keelrl.policy.prefix import chunked_token_logprobs
from keelrl.policy.prefix import can_share, find_prefix_units, prefix_token_logprobs
from keelrl.rollout.scheduler import prompt_tokens
from keelrl.rollout.trajectory import Batch, Trajectory, collate


class VocabularyMismatchError(ValueError):
    """The teacher's tokenizer is not the student's."""


def check_same_vocabulary(student_tokenizer: Any, teacher_tokenizer: Any, student_name: str, teacher_name: str) -> None:
    """Raise VocabularyMismatchError, naming both vocabularies, unless the tokenizers map the
    same strings to the same ids."""
    student, teacher = student_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    if student == teacher:
        return
    only_student = sorted(set(student) - set(teacher))[:3]
    only_teacher = sorted(set(teacher) - set(student))[:3]
    moved = sorted(token for token in set(student) & set(teacher) if student[token] != teacher[token])[:3]
    raise VocabularyMismatchError(
        f"distill.teacher {teacher_name!r} has a {len(teacher)}-token vocabulary and the student {student_name!r} "
        f"a {len(student)}-token one, and they differ (only the student's: {only_student}; only the teacher's: "
        f"{only_teacher}; different ids: {moved}): the teacher must score the student's own token ids, so "
        f"it needs the student's tokenizer")


def privileged_hint(task: Any) -> str:
    """What the self-teacher sees and the student does not: the task's reference fix."""
    fix = getattr(task, "reference_fix", None)
    if not fix:
        raise ValueError(f"task {getattr(task, 'id', task)!r} has no reference fix to show a self-distillation teacher")
    files = "\n\n".join(f"{name}:\n```python\n{content.rstrip()}\n```" for name, content in sorted(fix.items()))
    return f"(Privileged reference, for the teacher only: a correct version of the code.)\n{files}\n\n"


@dataclass
class TeacherView:
    """A batch as the teacher reads it: [B, T'] tensors, and for row r the teacher's position of
    the student's position t is t + shift[r] (0 for a teacher that reads the student's ids)."""

    batch: Batch
    shift: Tensor  # [B] long


class Teacher:
    """Scores a student's rollouts (see the module docstring)."""

    def __init__(self, cfg: DistillConfig, student: Any, tokenizer: Any, *, student_name: str, device: torch.device,
                 tasks: Sequence[Any] = (), temperature: float = 1.0, max_tokens: int = 2048,
                 model: Any = None, model_tokenizer: Any = None) -> None:
        """`model`, `model_tokenizer`: an already loaded teacher for mode=on_policy (else it is
        loaded from cfg.teacher)."""
        self.cfg = cfg
        self.student = student
        self.tokenizer = tokenizer
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.tasks = {task.id: task for task in tasks}
        self.model: Any = None
        if cfg.mode == "on_policy":
            if model is None:
                model, model_tokenizer = load_policy(cfg.teacher, device)
            check_same_vocabulary(tokenizer, model_tokenizer, student_name, cfg.teacher)
            self.model = model.eval().requires_grad_(False)

    @property
    def scorer(self) -> Any:
        """The model that scores: the second model, or (self) the student."""
        return self.student if self.model is None else self.model

    def view(self, batch: Batch, trajectories: Sequence[Trajectory], pad_id: int) -> TeacherView:
        """The teacher's layout of `batch` (the collated `trajectories`, in order)."""
        device = batch.input_ids.device
        if self.model is not None:
            return TeacherView(batch, torch.zeros(batch.input_ids.shape[0], dtype=torch.long, device=device))
        rows, shifts = [], []
        for trajectory in trajectories:
            task = self.tasks.get(trajectory.task_id)
            if task is None:
                raise KeyError(f"self-distillation: task {trajectory.task_id!r} is not a training task")
            prompt = prompt_tokens(self.tokenizer, privileged_hint(task) + trajectory.prompt)
            tail = slice(trajectory.prompt_length, len(trajectory.token_ids))
            tokens = prompt + trajectory.token_ids[tail]
            rows.append(Trajectory(trajectory.task_id, trajectory.group_id, token_ids=tokens,
                                   action_mask=[False] * len(prompt) + trajectory.action_mask[tail],
                                   behaviour_logprobs=[0.0] * len(tokens), turn_ids=[0] * len(tokens),
                                   prompt_length=len(prompt), reward=trajectory.reward))
            shifts.append(len(prompt) - trajectory.prompt_length)
        teacher_batch = collate(rows, pad_id)
        return TeacherView(teacher_batch.to(device), torch.tensor(shifts, dtype=torch.long, device=device))

    @torch.no_grad()
    def logprobs(self, view: TeacherView, student_mask: Tensor, keys: Tensor | None) -> Tensor:
        """log pi_T of each sampled action token, [B, T] in the student's layout (0 elsewhere)."""
        teacher = view.batch
        logp = chunked_token_logprobs(self.scorer, teacher.input_ids, teacher.attention_mask, max_tokens=self.max_tokens,
                                      positions=teacher.action_mask, temperature=self.temperature, keys=keys)["logp"]
        return to_student_layout(logp, view.shift, student_mask)

    @torch.no_grad()
    def action_logits(self, view: TeacherView, rows: Tensor) -> Tensor:
        """The teacher's next-token logits (float32 at least, at the sampling temperature) at
        every action token of `rows`, [n, V] in row-major order of the action mask."""
        teacher = view.batch
        width = int(teacher.attention_mask[rows].sum(1).max())
        ids, attention = teacher.input_ids[rows, :width], teacher.attention_mask[rows, :width]
        action = teacher.action_mask[rows, :width]
        units = find_prefix_units(ids, attention, teacher.group_ids[rows].cpu(), action)
        if can_share(self.scorer, units):  # a group's shared prompt runs once (keelrl.policy.prefix)
            hidden = prefix_token_logprobs(self.scorer, ids, attention, units, positions=action,
                                           with_hidden=True)["hidden"]
        else:
            hidden = self.scorer.model(input_ids=ids, attention_mask=attention, use_cache=False).last_hidden_state
        return head_logits(self.scorer, hidden, action, self.temperature)


def head_logits(model: Any, hidden: Tensor, action_mask: Tensor, temperature: float) -> Tensor:
    """Next-token logits predicting each action token: hidden [b, t, H] at the position before
    each True of action_mask [b, t] -> [n, V], row-major, in float32 at least, over temperature."""
    rows, steps = action_mask[:, 1:].nonzero(as_tuple=True)
    return output_logits(model.get_output_embeddings(), hidden[rows, steps], temperature)


def to_student_layout(values: Tensor, shift: Tensor, student_mask: Tensor) -> Tensor:
    """values [B, T'] in the teacher's layout -> [B, T] at the student's action positions
    (position t of row r reads t + shift[r]); 0 elsewhere."""
    batch, width = student_mask.shape
    source = (torch.arange(width, device=values.device).unsqueeze(0) + shift.unsqueeze(1)).clamp(0, values.shape[1] - 1)
    return torch.where(student_mask, values.gather(1, source), torch.zeros((), dtype=values.dtype, device=values.device))
