"""Process reward model: a step scorer trained on hidden-check progress, used as a per-turn
surrogate value.

Labels come from the environment, not from annotators: with `prm.enabled` the rollouts grade
the hidden checks after every turn that can change the code (`EpisodeLimits.label_steps`), and
a turn is labelled 1 when it raised the pass count, 0 when it did not (a malformed edit
included); reads, test runs and the submission get no label.

The scorer is a logistic probe on the policy body: a linear layer on the hidden state at the
turn's last action token (which has seen the whole action), giving P(the turn made progress).
It reads the hidden states the learner's no-gradient pass computes anyway (no extra forward
pass during training), and its loss never reaches the policy. It is refitted every step with
its own optimizer on a buffer of the most recent labelled turns (`prm.buffer`), with the two
classes weighted equally (progress is rare early on). Its accuracy on a batch is measured
before the batch is fitted, and on the held-out evaluation's turns, so neither is a training
accuracy.

Used as a surrogate value (`prm.weight` > 0), each labelled turn's action tokens get
`weight x (score - mean score of its group's labelled turns)` added to their advantage: a
turn the scorer rates above its siblings is credited even when the episode's outcome is not.
`prm.scorer=false` keeps the labels (and the trajectory-B measurement they give) without the
scorer: nothing then needs the hidden states, so a step's first update takes its rows' proximal
log-probs from its own pass, and a step that makes one update runs no no-grad pass at all
(`AdvantageStage.update_gives_prox`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from keelrl.rollout.trajectory import Batch


class ProcessRewardModel:
    """The step scorer, its optimizer and its replay buffer of (hidden state, label)."""

    def __init__(self, hidden_size: int, device: torch.device, *, lr: float, fit_steps: int, buffer: int) -> None:
        self.linear = nn.Linear(hidden_size, 1).to(device)
        nn.init.zeros_(self.linear.weight)  # P = 0.5 everywhere until the first fit
        nn.init.zeros_(self.linear.bias)
        self.optimizer = torch.optim.AdamW(self.linear.parameters(), lr=lr, weight_decay=0.0)
        self.fit_steps, self.capacity = fit_steps, buffer
        self.features = torch.zeros(0, hidden_size, device=device)
        self.labels = torch.zeros(0, device=device)

    def logits(self, features: Tensor) -> Tensor:
        """features [n, H] (hidden states at turns' last action tokens) -> logits [n], float32."""
        return self.linear(features.detach().float()).squeeze(-1)

    @torch.no_grad()
    def scores(self, features: Tensor) -> Tensor:
        """features [n, H] -> P(the turn raised the pass count) [n]."""
        return torch.sigmoid(self.logits(features))

    def fit(self, features: Tensor, labels: Tensor) -> dict[str, float]:
        """Add (features [n, H], labels [n] in {0, 1}) to the buffer and refit on it -> metrics."""
        self.features = torch.cat([self.features, features.detach().float()])[-self.capacity:]
        self.labels = torch.cat([self.labels, labels.float()])[-self.capacity:]
        positives = self.labels.sum()
        negatives = len(self.labels) - positives
        if len(self.labels) == 0:
            return {}
        # Each class weighs half (one class alone: plain mean).
        weights = torch.where(self.labels > 0.5, 0.5 / positives.clamp(min=1), 0.5 / negatives.clamp(min=1))
        if positives == 0 or negatives == 0:
            weights = torch.full_like(self.labels, 1.0 / len(self.labels))
        loss = torch.zeros(())
        with torch.enable_grad():
            for _ in range(self.fit_steps):
                self.optimizer.zero_grad(set_to_none=True)
                per_turn = nn.functional.binary_cross_entropy_with_logits(self.logits(self.features), self.labels,
                                                                          reduction="none")
                loss = (per_turn * weights).sum()
                loss.backward()
                self.optimizer.step()
        return {"prm/loss": float(loss.detach()), "prm/buffer": float(len(self.labels))}

    def state_dict(self) -> dict[str, Any]:
        return {"linear": self.linear.state_dict(), "optimizer": self.optimizer.state_dict(),
                "features": self.features, "labels": self.labels}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.linear.load_state_dict(state["linear"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.features, self.labels = state["features"], state["labels"]


def labelled_turns(batch: Batch) -> tuple[Tensor, Tensor]:
    """-> (where [B, T] bool: the last action token of each labelled turn, labels [n] in {0, 1})."""
    if batch.step_labels is None:
        where = torch.zeros_like(batch.action_mask)
        return where, torch.zeros(0, dtype=torch.long, device=where.device)
    where = batch.step_labels >= 0
    return where, batch.step_labels[where]


def classification_metrics(scores: Tensor, labels: Tensor, prefix: str) -> dict[str, float]:
    """Accuracy at 0.5, balanced accuracy (the mean of the two classes' recalls) and the label
    balance of scores [n] against labels [n]; {} without labels."""
    if labels.numel() == 0:
        return {f"{prefix}turns": 0.0}
    predicted, truth = scores > 0.5, labels > 0
    recalls = [float((predicted[truth == cls] == cls).float().mean()) for cls in (True, False)
               if bool((truth == cls).any())]
    return {f"{prefix}accuracy": float((predicted == truth).float().mean()),
            f"{prefix}balanced_accuracy": sum(recalls) / len(recalls),
            f"{prefix}positive_frac": float(truth.float().mean()), f"{prefix}turns": float(labels.numel())}


def process_advantages(scores: Tensor, where: Tensor, batch: Batch, weight: float) -> Tensor:
    """weight x (each labelled turn's score - the mean score of its group's labelled turns),
    on every action token of the turn: [B, T] (0 on unlabelled turns and non-action tokens).

    scores [n] are in the order of `where.nonzero()`; a group with one labelled turn gets 0.
    """
    rows, positions = where.nonzero(as_tuple=True)
    mask = batch.action_mask
    result = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    if rows.numel() == 0:
        return result
    groups, inverse = batch.group_ids[rows].unique(return_inverse=True)
    sums = torch.zeros(len(groups), device=scores.device).index_add_(0, inverse, scores.float())
    counts = torch.bincount(inverse, minlength=len(groups)).float()
    centred = weight * (scores.float() - (sums / counts)[inverse])  # [n]
    turns = batch.turn_ids[rows, positions]
    per_turn = torch.zeros(mask.shape[0], int(batch.turn_ids.max()) + 1, device=mask.device)
    per_turn[rows, turns] = centred
    return torch.where(mask, per_turn.gather(1, batch.turn_ids.long()), 0.0)
