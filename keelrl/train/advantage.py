"""The advantage stage: from a collated batch to what the step's updates read.

In this order, all without gradients:
1. the no-grad passes: the policy's proximal log-probs (with the critic's values and, for the
   process reward model, the hidden states at labelled turns) unless the update's own pass
   gives them: every row's with one update a step (`prox_from_update`), else those of the step's
   first update (`update_gives_prox`); and the frozen reference's log-probs (a LoRA policy's
   reference: the policy's own model, its adapter off or as RL started, keelrl.policy.lora);
2. the outcome reward (with `algo.overlong=penalty`, plus DAPO's soft overlong punishment:
   keelrl.algos.overlong) on the last action token, each turn's own reward (`Batch.step_rewards`:
   an environment's per-turn reward, e.g. the coding environment's potential-based shaping) on
   that turn's last action token, less the KL penalty when it is in the reward
   (`algo.kl_in_reward`);
3. the registered advantage estimator (group baseline, or critic + GAE); where an episode gave
   several samples (a harness that rewrote its history: `Batch.episode_ids`), an outcome
   estimator runs over episodes, each counted once in its group with the rewards of all its
   samples, and every sample's action tokens get its episode's advantage (`episode_advantages`);
4. process reward shaping: the process reward model scores the turns (before it is fitted on
   this batch: an out-of-sample accuracy), adds `prm.weight` x its advantages, then fits;
5. distillation shaping: minus `distill.coef` x the teacher's sampled reverse KL per token
   (`distill.form=advantage`; the teacher's pass runs here for that form alone, the loss form
   reads the teacher in the update);
6. for a batch the teacher sampled (GKD), no RL term: advantages 0, the student's own
   pre-update log-probs as the behaviour log-probs;
7. otherwise, with `algo.overlong=mask`, the episodes cut by a limit leave the updates' action
   mask (their advantages 0), after steps 2-5 counted them in their groups' baselines.

Every step logs `train/overlong_frac`, the share of the batch's episodes a limit cut, whatever
`algo.overlong` does with them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from keelrl.algos import compute_advantages, correction_weights, outcome_to_token_rewards
from keelrl.algos.advantages import AdvantageOutput, trajectory_scores
from keelrl.algos.registries import ADVANTAGES
from keelrl.algos.config import AlgoConfig
from keelrl.algos.distill import sampled_reverse_kl
from keelrl.algos.losses import kl_reward_penalty
from keelrl.algos.overlong import overlong_filter, overlong_shaping
from keelrl.config import KeelConfig
from keelrl.policy.lora import AdapterReference
from keelrl.policy.prefix import chunked_token_logprobs
from keelrl.rollout.trajectory import Batch
from keelrl.train.distill import Teacher, TeacherView
from keelrl.train.learner import UpdateInputs, prefix_keys
from keelrl.train.prm import ProcessRewardModel, classification_metrics, labelled_turns, process_advantages


def arrival_stats(prox_logp: Tensor, batch: Batch, algo: AlgoConfig) -> dict[str, float]:
    """How off-policy the batch arrived, over its action tokens: the importance weight pi_prox / mu
    (`rollout/arrival_*`), the KL between the sampler's mu and the learner's pi_prox (`mismatch/*`,
    `keelrl.algos.corrections.mismatch_metrics`) and what `algo.rollout_correction` does to the batch
    (`correction/*`: the weights the updates multiply the tokens' losses by).

    Every RL step logs these: from the no-grad pass's pi_prox, or, when the update's own pass
    gives pi_prox (`AdvantageStage.prox_from_update`), from that pass's detached log-probs
    (`UpdateResult.prox_logp`, the trainer's call after the update)."""
    mask = batch.action_mask
    log_w = (prox_logp - batch.behaviour_logprobs).masked_fill(~mask, 0.0).clamp(-algo.max_log_ratio,
                                                                                 algo.max_log_ratio)
    arrival = torch.exp(log_w)  # [B, T]
    stats = {"rollout/arrival_is_weight_mean": (arrival * mask).sum().item() / max(1, int(mask.sum())),
             "rollout/arrival_is_weight_max": arrival.masked_fill(~mask, 0.0).max().item()}
    _, metrics = correction_weights(prox_logp, batch.behaviour_logprobs, mask, algo)
    stats.update({key: float(value) for key, value in metrics.items()})
    return stats


def zero_advantage_frac(batch: Batch) -> float:
    """Share of the batch's rows whose group has all-equal rewards (nothing to learn from them)."""
    same = batch.group_ids.unsqueeze(0) == batch.group_ids.unsqueeze(1)
    spread = torch.where(same, batch.rewards.unsqueeze(0), float("nan"))
    mixed = (spread.nan_to_num(-1e9).amax(1) != spread.nan_to_num(1e9).amin(1)).float()
    return 1.0 - mixed.mean().item()


def turn_credit(advantages: Tensor, batch: Batch, marked: Tensor) -> tuple[int, float]:
    """The turns holding a `marked` position ([B, T] bool) -> (how many, the share whose mean
    advantage over the turn's action tokens is positive; NaN when none)."""
    mask = batch.action_mask
    turns = batch.turn_ids.long()
    width = int(turns.max()) + 1 if turns.numel() else 1
    sums = torch.zeros(mask.shape[0], width, dtype=torch.float64, device=mask.device)
    sums.scatter_add_(1, turns, advantages.double().masked_fill(~mask, 0.0))
    counts = torch.zeros_like(sums).scatter_add_(1, turns, mask.double())
    rows, positions = marked.nonzero(as_tuple=True)
    hit = torch.zeros(sums.shape, dtype=torch.bool, device=sums.device)
    hit[rows, turns[rows, positions]] = True  # [B, K]: the marked turns
    turn_mean = sums[hit] / counts[hit].clamp(min=1)
    return int(turn_mean.numel()), float((turn_mean > 0).double().mean()) if turn_mean.numel() else math.nan


def good_turn_credit(advantages: Tensor, batch: Batch) -> dict[str, float]:
    """The lecture's trajectory-B measurement over the batch: among the turns of failed episodes
    (outcome reward below 1) that raised the hidden-check pass count (process label 1, so only
    with `prm.enabled`), how many there are (`credit/good_turns`) and the share whose mean
    advantage over the turn's action tokens is positive (`credit/good_turn_positive_frac`).
    One advantage broadcast over an episode gives every such turn its failure's sign; per-turn
    credit can reward the good turn inside it. Only rows the loss reads count (`action_mask`);
    {} when no turn is labelled."""
    if batch.step_labels is None or not bool((batch.step_labels >= 0).any()):
        return {}
    good = (batch.step_labels == 1) & (batch.rewards < 1.0).unsqueeze(1) & batch.action_mask  # [B, T]: a good
    # turn's last action token, in a row the loss reads
    count, share = turn_credit(advantages, batch, good)
    if count == 0:
        return {"credit/good_turns": 0.0}
    return {"credit/good_turns": float(count), "credit/good_turn_positive_frac": share}


def rejected_turn_credit(advantages: Tensor, batch: Batch) -> dict[str, float]:
    """The mirror of `good_turn_credit`: among the batch's turns whose action the environment
    rejected (`Batch.rejected`: a malformed call, a bad argument), how many there are
    (`credit/rejected_turns`) and the share whose mean advantage over the turn's action tokens is
    positive (`credit/rejected_turn_positive_frac`): the update makes those malformed actions more
    likely. An outcome advantage gives a rejected turn of a successful episode its success's sign;
    per-turn credit with `env.malformed_cost` can charge the turn itself. Only the tokens the loss
    reads count (`action_mask`); {} without `batch.rejected`."""
    if batch.rejected is None:
        return {}
    count, share = turn_credit(advantages, batch, batch.rejected & batch.action_mask)
    if count == 0:
        return {"credit/rejected_turns": 0.0}
    return {"credit/rejected_turns": float(count), "credit/rejected_turn_positive_frac": share}


def episode_advantages(token_rewards: Tensor, mask: Tensor, rewards: Tensor, group_ids: Tensor,
                       episode_ids: Tensor, algo: AlgoConfig) -> AdvantageOutput:
    """token_rewards, mask [B, T], rewards, group_ids, episode_ids [B] -> advantages [B, T]: each
    sample's action tokens get its episode's advantage.

    `rewards` are the outcome rewards on each row's last action token (an episode's samples all
    carry its outcome; where a length penalty shaped them, the episode's last sample's counts). An
    episode's score is its outcome, once, plus whatever else its samples'
    tokens were rewarded (their turns' rewards, a KL penalty); the outcome estimator
    `algo.advantage` runs over one score per episode, so an episode split into k samples weighs in
    its group's baseline as one episode, not k. ValueError for an estimator whose advantage varies
    within an episode (per turn, or from a critic): a split episode has no single run of turns."""
    if "outcome" not in ADVANTAGES.entry(algo.advantage).tags:
        estimators = [name for name in ADVANTAGES.names() if "outcome" in ADVANTAGES.entry(name).tags]
        raise ValueError(f"algo.advantage={algo.advantage} cannot credit an episode split into several samples "
                         f"(a harness rewrote its history); use an outcome estimator: {', '.join(estimators)}")
    has_action = mask.any(dim=1)
    extra = trajectory_scores(token_rewards, mask) - torch.where(has_action, rewards.to(token_rewards.dtype), 0.0)
    episodes, row_episode = torch.unique(episode_ids.to(mask.device), return_inverse=True)
    count = len(episodes)
    rows = torch.arange(len(row_episode), device=row_episode.device)
    last_row = torch.full((count,), -1, dtype=torch.long, device=row_episode.device).scatter_reduce(
        0, row_episode, rows, reduce="amax")  # each episode's last sample: its outcome (shaped by its length)
    outcome = rewards.to(token_rewards.dtype)[last_row]  # [E]
    scores = outcome + token_rewards.new_zeros(count).index_add_(0, row_episode, extra)  # [E]
    groups = group_ids.new_zeros(count).scatter_(0, row_episode, group_ids)
    one = torch.ones((count, 1), dtype=torch.bool, device=mask.device)
    out = compute_advantages(token_rewards=scores.unsqueeze(1), mask=one, group_ids=groups, cfg=algo)
    per_row = out.advantages[:, 0][row_episode]  # [B]
    advantages = torch.where(mask, per_row.unsqueeze(1).to(token_rewards.dtype), torch.zeros_like(token_rewards))
    return AdvantageOutput(advantages, torch.zeros_like(token_rewards))


@dataclass
class Advantages:
    """The stage's result: the updates' inputs and the stage's own metrics."""

    inputs: UpdateInputs
    stats: dict[str, float]


class AdvantageStage:
    """Runs the stage (module docstring) with the run's models: the policy, and those of them the
    config asks for (critic, frozen reference, process reward model, teacher)."""

    def __init__(self, cfg: KeelConfig, model: Any, value_head: Any, reference: Any,
                 prm: ProcessRewardModel | None, teacher: Teacher | None, autocast: Any) -> None:
        self.cfg, self.model, self.value_head, self.reference = cfg, model, value_head, reference
        self.prm, self.teacher, self.autocast = prm, teacher, autocast

    def update_gives_prox(self) -> bool:
        """Whether the rows of a step's first update may take their proximal log-probs from that
        update's own forward pass, which runs on the weights the step started from, instead of a
        no-grad pass before it (a quarter of the learner's work for those rows).

        Only with one epoch (a second would update those rows again on moved weights) and without
        a critic, a process reward model or a teacher of the advantage form, which need the
        pre-update pass's values, hidden states or log-probs for every row before the update starts.
        A loss-form teacher (`distill.form=loss`) does not: its term reads the teacher's logits in
        the update, and its sampled reverse KL (a metric) is taken after the update
        (`Learner.update`'s teacher log-probs). A batch the teacher sampled still gets the whole
        pass (its behaviour log-probs, step 6).
        """
        return (self.cfg.train.epochs == 1 and self.value_head is None and self.prm is None
                and (self.teacher is None or self.cfg.distill.form == "loss"))

    def prox_from_update(self, batch: Batch) -> bool:
        """Whether every row's proximal log-probs come from the update's own pass (`update_gives_prox`
        with the whole batch one minibatch, one update a step): no no-grad pass at all."""
        return self.update_gives_prox() and batch.input_ids.shape[0] <= self.cfg.train.minibatch_size

    @torch.no_grad()
    def __call__(self, batch: Batch, teacher_view: TeacherView | None = None,
                 sampled_by_teacher: bool = False, first_update: Sequence[int] = ()) -> Advantages:
        """Steps 1-7 of the module docstring over `batch`. `teacher_view`: the teacher's side of
        the batch (distillation); `sampled_by_teacher`: the teacher sampled the batch (step 6);
        `first_update`: the rows of the step's first minibatch (`Learner.first_update_rows`),
        whose proximal log-probs the update's own pass gives where `update_gives_prox`: the
        no-grad pass then runs over the other rows only (`UpdateInputs.prox_own`)."""
        algo, temperature = self.cfg.algo, self.cfg.rollout.temperature
        if self.model is not None:  # no dropout in the no-grad passes (model.lora.dropout); the updates train() it again
            self.model.eval()
        mask = batch.action_mask
        budget = self.cfg.perf.micro_batch_tokens
        keys = prefix_keys(self.cfg.perf, batch)
        steps, step_labels = labelled_turns(batch)
        prox_out: dict[str, Tensor] = {}
        prox_own = None
        gives = self.update_gives_prox() and not sampled_by_teacher  # step 6 needs every row's pre-update pass
        whole = gives and self.prox_from_update(batch)
        rows = batch.input_ids.shape[0]
        if not whole and gives and 0 < len(set(first_update)) < rows:  # no-grad: the later updates' rows
            prox_own = torch.zeros(rows, dtype=torch.bool, device=batch.input_ids.device)
            prox_own[list(first_update)] = True
            rest = (~prox_own).nonzero(as_tuple=True)[0]
            with self.autocast():
                rest_logp = chunked_token_logprobs(self.model, batch.input_ids[rest], batch.attention_mask[rest],
                                                   max_tokens=budget, positions=mask[rest], temperature=temperature,
                                                   keys=None if keys is None else keys[rest.cpu()])["logp"]
            prox_out["logp"] = rest_logp.new_zeros(mask.shape)
            prox_out["logp"][rest] = rest_logp
        elif not whole:
            with self.autocast():  # the same precision as the update's passes: fresh ratios stay 1
                prox_out = chunked_token_logprobs(self.model, batch.input_ids, batch.attention_mask, max_tokens=budget,
                                                  value_fn=self.value_head, positions=mask, temperature=temperature,
                                                  keys=keys, hidden_at=steps if self.prm is not None else None)
        prox_logp = prox_out.get("logp")
        cut = batch.cut if batch.cut is not None else torch.zeros_like(batch.group_ids, dtype=torch.bool)
        rewards, overlong_stats = overlong_shaping(batch.rewards, lengths=batch.attention_mask.sum(1), cut=cut,
                                                   max_len=self.cfg.rollout.max_context_tokens, cfg=algo)
        token_rewards = outcome_to_token_rewards(rewards, mask)
        if batch.step_rewards is not None:
            token_rewards = token_rewards + batch.step_rewards.to(token_rewards.dtype).masked_fill(~mask, 0.0)
        ref_logp = None
        if self.reference is not None:
            # a LoRA policy's reference runs on the policy's own model (keelrl.policy.lora.AdapterReference)
            adapter = isinstance(self.reference, AdapterReference)
            reference = self.reference.model if adapter else self.reference
            with self.reference.active() if adapter else contextlib.nullcontext(), self.autocast():
                ref_logp = chunked_token_logprobs(reference, batch.input_ids, batch.attention_mask,
                                                  max_tokens=budget, positions=mask, temperature=temperature,
                                                  keys=keys)["logp"]
            if algo.kl_in_reward:
                token_rewards = kl_reward_penalty(token_rewards, batch.behaviour_logprobs, ref_logp, mask,
                                                  algo.kl_coef, algo.kl_estimator)
        values = prox_out.get("values")
        if batch.episode_ids is not None:
            out = episode_advantages(token_rewards, mask, rewards, batch.group_ids, batch.episode_ids, algo)
        else:
            out = compute_advantages(token_rewards=token_rewards, mask=mask, group_ids=batch.group_ids, cfg=algo,
                                     values=values, turn_ids=batch.turn_ids)
        advantages = out.advantages
        stats: dict[str, float] = {
            "train/zero_advantage_frac": zero_advantage_frac(dataclasses.replace(batch, rewards=rewards)),
            "train/overlong_frac": cut.float().mean().item(),
            **{key: float(value) for key, value in overlong_stats.items()}}
        prm_stats: dict[str, float] = {}
        if self.prm is not None:
            features = prox_out["hidden_at"]
            scores = self.prm.scores(features)  # before this batch is fitted: an out-of-sample accuracy
            prm_stats = classification_metrics(scores, step_labels, "prm/")
            if self.cfg.prm.weight > 0:
                advantages = advantages + process_advantages(scores, steps, batch,
                                                             self.cfg.prm.weight).to(advantages.dtype)
            prm_stats.update(self.prm.fit(features, step_labels))
        if self.teacher is not None and teacher_view is not None and self.cfg.distill.form == "advantage":
            # (the loss form's sampled KL is the trainer's, from the teacher's logits in the update)
            teacher_logp = self.teacher.logprobs(teacher_view, mask, keys)
            assert prox_logp is not None  # a teacher keeps the pre-update pass
            sampled_kl = sampled_reverse_kl(prox_logp, teacher_logp).masked_fill(~mask, 0.0)  # [B, T]
            stats["distill/sampled_kl"] = sampled_kl.sum().item() / max(1, int(mask.sum()))
            if self.cfg.distill.form == "advantage":  # a dense per-token reward: -coef x the sampled reverse KL
                advantages = advantages - self.cfg.distill.coef * sampled_kl.to(advantages.dtype)
        stats.update(prm_stats)
        if not sampled_by_teacher:  # 7: the teacher's cut samples are still its samples to distil
            advantages, loss_mask, filter_stats = overlong_filter(advantages, mask, cut, algo)
            batch = dataclasses.replace(batch, action_mask=loss_mask)
            stats.update({key: float(value) for key, value in filter_stats.items()})
            # The credit the update gives, as its loss reads it (rows the filter masked give none);
            # a teacher's samples get no RL credit at all (below), so nothing to measure there.
            stats.update(good_turn_credit(advantages, batch))
            stats.update(rejected_turn_credit(advantages, batch))
        if prox_logp is not None and prox_own is None:  # else the trainer's, after the update fills the rest
            stats.update(arrival_stats(prox_logp, batch, algo))
        if sampled_by_teacher:  # another policy's samples: distil on them, do not reinforce them
            assert prox_logp is not None  # a teacher keeps the pre-update pass
            advantages = torch.zeros_like(advantages)
            batch = dataclasses.replace(batch, behaviour_logprobs=prox_logp.to(batch.behaviour_logprobs.dtype)
                                        .masked_fill(~mask, 0.0))
            stats.pop("distill/sampled_kl", None)  # a KL under the teacher's samples, not the student's
            # The student's own log-probs are now mu: the batch arrives on-policy by construction.
            stats.update(arrival_stats(batch.behaviour_logprobs, batch, algo))
        inputs = UpdateInputs(batch=batch, advantages=advantages, returns=out.returns, old_values=values,
                              ref_logp=ref_logp, prox_logp=prox_logp, prox_own=prox_own, teacher_view=teacher_view)
        return Advantages(inputs, stats)
