"""The learner: a step's optimiser updates, as minibatches run in micro-batches.

Memory. No forward pass sees more than `perf.micro_batch_tokens` padded tokens (rows x
longest row): each optimiser minibatch (of RL and of the warm start) runs as micro-batches
whose gradients accumulate into the update of one pass over the minibatch. A row longer than
the budget runs alone, over budget. The aggregation modes weigh tokens by minibatch-wide
normalisers (the minibatch's action tokens, its rows, its rows with actions);
`aggregation_weights` reads each mode's token weights off the registered function, and each
micro-batch's loss is scaled so that its weights are the minibatch's weights on its rows
(`micro_batch_scale`): the scaled micro-batch losses sum to the minibatch loss for every mode
whose loss is linear in the per-token terms, and any other mode fails loudly.

The sampler -> learner correction (`algo.rollout_correction`, keelrl.algos.corrections) is
applied inside `policy_objective`, per micro-batch, from the rows' behaviour log-probs mu and
their proximal log-probs: the inputs', or the pass's own detached ones, which the step's single
update computes before any weight moves. A micro-batch holds whole rows, so the sequence-level
corrections see every action token of a row.

One step's updates read one `UpdateInputs` (fixed before the first update) and give one
`UpdateResult`; `Learner.update` runs `train.epochs` passes over the batch in minibatches of
whole groups, with the step's learning rate, skipping (and counting) any update whose loss or
gradient is not finite. A minibatch with no token in any loss term (every row an overlong episode
that `algo.overlong=mask` left out) makes no optimiser step and is not counted.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor

from keelrl.algos import policy_objective, value_loss
from keelrl.algos.config import AlgoConfig
from keelrl.algos.distill import forward_kl, generalized_jsd, reverse_kl, top_token_disagreement
from keelrl.algos.losses import aggregate, token_view
from keelrl.config import KeelConfig
from keelrl.policy.lora import trainable_parameters
from keelrl.policy.model import learner_autocast, row_lengths, split_rows, token_logprobs
from keelrl.policy.prefix import micro_logprobs, plan_passes
from keelrl.rollout.trajectory import Batch
from keelrl.train.distill import Teacher, TeacherView, head_logits
from keelrl.train.episodes import TokenRecord

OBJECTIVE_METRICS = frozenset({"policy/loss", "loss/total", "value/loss", "distill/loss"})
"""Metrics that are values of the aggregated objective: combined over micro-batches with the
loss scale. The others are action-token means (combined by token share), `*_max` (max) or
`*_min` (min)."""


def aggregation_weights(mask: Tensor, cfg: AlgoConfig) -> Tensor:
    """mask [B, T] -> weights [B, T] (float64) with aggregate(x, mask, cfg) == sum(weights * x) for all x.

    Read off the registered aggregation function by autograd, so every mode, present or
    future, is covered without a table typed by hand. Raises ValueError when the mode is not
    linear in the per-token terms (micro-batching could not split it).
    """
    count = mask.numel()
    probe = ((torch.arange(count, dtype=torch.float64, device=mask.device) * 0.618034) % 1.0 + 0.5)
    probe = probe.reshape(mask.shape).requires_grad_(True)  # [B, T], varied and non-zero
    with torch.enable_grad():
        total = aggregate(probe, mask, cfg)
        (weights,) = torch.autograd.grad(total, probe)
    if not torch.allclose(total.detach(), (weights * probe.detach()).sum(), rtol=1e-9, atol=1e-12):
        raise ValueError(f"algo.aggregation={cfg.aggregation!r} is not linear in the per-token losses, so "
                         f"perf.micro_batch_tokens cannot split a minibatch into micro-batches")
    return weights


def micro_batch_scale(minibatch_weights: Tensor, micro_mask: Tensor, cfg: AlgoConfig) -> float:
    """The factor s with s * aggregate(x, micro_mask) == sum(minibatch_weights * x) on the micro-batch's rows.

    minibatch_weights [b, t]: `aggregation_weights` of the whole minibatch, at the micro-batch's
    rows and columns; micro_mask [b, t]. E.g. token_mean: s = micro-batch action tokens /
    minibatch action tokens; seq_mean_token_sum and constant: s = b / minibatch rows.
    """
    micro_weights = aggregation_weights(micro_mask, cfg)
    scale = float(minibatch_weights.sum() / micro_weights.sum()) if micro_weights.sum() != 0 else 0.0
    if not torch.allclose(minibatch_weights, scale * micro_weights, rtol=1e-9, atol=1e-15):
        raise ValueError(f"algo.aggregation={cfg.aggregation!r} weighs a micro-batch's tokens differently from "
                         f"the whole minibatch, so perf.micro_batch_tokens cannot split it; raise "
                         f"perf.micro_batch_tokens above the minibatch's padded tokens")
    return scale


def combine_micro_metrics(parts: Sequence[tuple[dict[str, Tensor], float, float, bool]]) -> dict[str, float]:
    """Per-micro-batch metrics -> the minibatch's. Each part: (metrics, loss scale, share of the
    minibatch's action tokens, has action tokens).

    Objective values (OBJECTIVE_METRICS) add up with the loss scale, `*_max` and `*_min` metrics
    take the max and the min over micro-batches with action tokens, and the rest (action-token means) add up with
    the token share.
    """
    combined: dict[str, float] = {}
    for key in parts[0][0]:
        if key in OBJECTIVE_METRICS:
            combined[key] = sum(float(metrics[key]) * scale for metrics, scale, _, _ in parts)
        elif key.endswith(("_max", "_min")):
            acted = [float(metrics[key]) for metrics, _, _, has_tokens in parts if has_tokens]
            combined[key] = (max if key.endswith("_max") else min)(acted) if acted else 0.0
        else:
            combined[key] = sum(float(metrics[key]) * share for metrics, _, share, _ in parts)
    return combined


def enable_gradient_checkpointing(model: Any) -> None:
    """Recompute `model`'s layer activations in backward passes (non-reentrant checkpoints).

    Takes effect only in training mode with gradients enabled, so sampling and no-grad passes
    are unaffected.
    """
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 renamed it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def prefix_keys(perf: Any, batch: Batch) -> Tensor | None:
    """Which rows of `batch` the learner's passes may run by shared prompt: those of one group
    (the plan checks the tokens). None, so every pass runs plainly, unless perf.share_prefix;
    never under activation checkpointing, which would replay the layers that fill the cache."""
    if not perf.share_prefix or perf.gradient_checkpointing:
        return None
    return batch.group_ids.cpu()


def group_order(group_ids: Sequence[int], rng: random.Random) -> list[int]:
    """Row indices with the groups in a shuffled order and each group's rows together (in attempt
    order): minibatches cut from it hold whole groups when train.minibatch_size is a multiple of
    the group size, so each group's shared prompt runs once in its minibatch (as verl counts its
    minibatches in prompts). Rows shuffled one by one would split every group across minibatches."""
    groups: dict[int, list[int]] = {}
    for row, group in enumerate(group_ids):
        groups.setdefault(group, []).append(row)
    keys = list(groups)
    rng.shuffle(keys)
    return [row for key in keys for row in groups[key]]


def take_rows(batch: Batch, rows: Tensor, width: int) -> Batch:
    """The rows `rows` of `batch`, with [B, T] fields cut to the first `width` positions."""
    fields: dict[str, Tensor | None] = {}
    for name, value in batch.__dict__.items():
        if value is None:
            fields[name] = None
            continue
        value = value[rows]
        fields[name] = value[:, :width] if value.dim() == 2 else value
    return Batch(**fields)  # type: ignore[arg-type]


@dataclass
class UpdateInputs:
    """What one step's updates read, all fixed before the first update ([B, T] unless noted)."""

    batch: Batch
    advantages: Tensor
    returns: Tensor
    old_values: Tensor | None
    """The critic's values before the update (clipped value loss); None without a critic."""
    ref_logp: Tensor | None
    """The frozen reference's log-probs (KL in the loss); None without one."""
    prox_logp: Tensor | None
    """pi_prox of the decoupled objective; None: each update's own (detached) pass gives it."""
    prox_own: Tensor | None = None
    """[B] bool, with prox_logp: the rows whose pi_prox is instead their update's own pass, those of
    the step's first update (`Learner.first_update_rows`), whose forward runs on the weights the
    step started from; prox_logp holds the other rows' (`AdvantageStage`'s no-grad pass)."""
    teacher_view: TeacherView | None = None
    """The teacher's side of the batch, for distill.form=loss."""


@dataclass
class MinibatchResult:
    """One minibatch's backward: its metrics (None: a micro-batch's loss was not finite, and the
    remaining ones did not run), the passes run, and each pass's own detached log-probs as
    (rows, width, logp [b, width]) when the inputs had no proximal log-probs; with a loss-form
    teacher, the teacher's log-prob of each sampled action token the same way (0 elsewhere)."""

    metrics: dict[str, float] | None
    passes: int
    own_logp: list[tuple[Tensor, int, Tensor]]
    teacher_logp: list[tuple[Tensor, int, Tensor]] = field(default_factory=list)


@dataclass
class UpdateResult:
    """One step's updates: the mean metrics over the updates made, their counts, the learning
    rate, and the proximal log-probs the updates used (the inputs', or their own passes')."""

    metrics: dict[str, float]
    updates: int
    skipped: int
    micro_batches: int
    lr: float
    prox_logp: Tensor
    teacher_logp: Tensor | None = None
    """With a loss-form teacher: the teacher's log-prob of each sampled action token the first
    epoch's updates scored, [B, T] (at the sampling temperature, as `Teacher.logprobs`), read
    from the logits its loss term used; None without one."""
    teacher_scored: Tensor | None = None
    """[B, T] bool: where teacher_logp holds a value (the action tokens of the minibatches that ran)."""


def adamw(params: Sequence[torch.nn.Parameter], lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW, its update fused into one kernel over all tensors where torch has one for the
    parameters' device (CPU and CUDA among them), else the per-tensor loop. The same update; the
    fused kernel reads and writes each tensor once instead of once per elementwise operation
    (docs/measurements.md#fused-adamw). Every step bumps the parameters' version counters, as an
    in-place write does."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    params = list(params)
    devices = {p.device.type for p in params}
    fused = bool(params) and devices <= set(_get_fused_kernels_supported_devices()) and all(
        p.dtype.is_floating_point for p in params)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)
    if fused:
        # The fused kernel writes the parameters without bumping their version counters, by which a
        # decoder sharing the model notices weights written without `load_weights` (the safety net
        # of keelrl.inference.weights, `weights_stamp`): bump them here.
        optimizer.register_step_post_hook(lambda opt, args, kwargs: torch.autograd.graph.increment_version(
            [p for group in opt.param_groups for p in group["params"]]))
    return optimizer


class Learner:
    """The policy's (and critic's) optimiser and the micro-batched passes that feed it."""

    def __init__(self, cfg: KeelConfig, model: Any, value_head: Any, teacher: Teacher | None,
                 device: torch.device) -> None:
        self.cfg, self.model, self.value_head, self.device = cfg, model, value_head, device
        self.loss_teacher = teacher if cfg.distill.form == "loss" else None
        self.optimizer = self.new_optimizer()

    def parameters(self) -> list[torch.nn.Parameter]:
        """The parameters that train, the optimiser's: the policy's (a LoRA policy's adapters alone,
        its base frozen: keelrl.policy.lora) and the critic's."""
        params = trainable_parameters(self.model)
        if self.value_head is not None:
            params += trainable_parameters(self.value_head)
        return params

    def new_optimizer(self) -> torch.optim.Optimizer:
        return adamw(self.parameters(), lr=self.cfg.optim.lr, weight_decay=self.cfg.optim.weight_decay)

    def autocast(self) -> Any:
        """The learner's precision context (`perf.learner_precision`); sampling never uses it."""
        return learner_autocast(self.device, self.cfg.perf.learner_precision)

    def step_lr(self, step: int) -> float:
        """RL step `step`'s learning rate (linear warmup over optim.warmup_steps), set on the optimiser."""
        optim = self.cfg.optim
        lr = optim.lr * min(1.0, step / optim.warmup_steps) if optim.warmup_steps else optim.lr  # step >= 1
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    # ----------------------------------------------------------------- RL updates
    def update(self, inputs: UpdateInputs, group_ids: Sequence[int], step: int,
               record: TokenRecord | None = None) -> UpdateResult:
        """train.epochs passes over the batch in minibatches of whole groups (`group_order` of
        `group_ids`, one per row), one optimiser step each. Rows without proximal log-probs in
        `inputs` (none given, or `prox_own`'s) take their update's own, detached; the result's
        prox_logp has every row's. `record`: the first epoch's per-token
        log-prob, ratio and clip, as its losses see them, are stored there (for episodes/)."""
        train = self.cfg.train
        lr = self.step_lr(step)
        self.model.train()
        sums: dict[str, float] = {}
        updates = skipped = micro_batches = 0
        given = inputs.prox_logp
        prox = given.clone() if given is not None else torch.zeros_like(inputs.batch.behaviour_logprobs)
        teacher_logp = teacher_scored = None
        if self.loss_teacher is not None:
            teacher_logp = torch.zeros_like(inputs.batch.behaviour_logprobs)
            teacher_scored = torch.zeros_like(inputs.batch.action_mask, dtype=torch.bool)
        orders = self.orders(group_ids, step)
        if inputs.prox_own is not None and (set(inputs.prox_own.nonzero().flatten().tolist())
                                            != set(orders[0][:train.minibatch_size])):
            raise ValueError("UpdateInputs.prox_own must mark exactly the rows of the step's first minibatch "
                             "(Learner.first_update_rows): only that update's pass runs on the weights the step "
                             "started from")
        for epoch, order in enumerate(orders):
            for start in range(0, len(order), train.minibatch_size):
                rows = torch.tensor(order[start:start + train.minibatch_size], device=self.device)
                if not self.has_loss_terms(inputs.batch, rows):  # e.g. every row cut and masked (algo.overlong)
                    continue
                own = given is None or (inputs.prox_own is not None and epoch == 0 and start == 0)
                self.optimizer.zero_grad(set_to_none=True)
                result = self.accumulate_gradients(inputs, rows, record=record if epoch == 0 else None, own_prox=own)
                micro_batches += result.passes
                for micro_rows, width, logp in result.own_logp:
                    prox[micro_rows, :width] = logp
                if epoch == 0 and teacher_logp is not None and teacher_scored is not None:
                    for micro_rows, width, logp in result.teacher_logp:
                        teacher_logp[micro_rows, :width] = logp
                        teacher_scored[micro_rows, :width] = inputs.batch.action_mask[micro_rows, :width]
                metrics = result.metrics
                if metrics is None:  # a micro-batch's loss was not finite
                    self.optimizer.zero_grad(set_to_none=True)
                    skipped += 1
                    continue
                grad_norm = torch.nn.utils.clip_grad_norm_(self.parameters(), self.cfg.optim.max_grad_norm)
                if not torch.isfinite(grad_norm):
                    self.optimizer.zero_grad(set_to_none=True)
                    skipped += 1
                    continue
                self.optimizer.step()
                updates += 1
                metrics["train/grad_norm"] = float(grad_norm)
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0.0) + value
        return UpdateResult({key: value / max(1, updates) for key, value in sums.items()}, updates, skipped,
                            micro_batches, lr, prox, teacher_logp, teacher_scored)

    def orders(self, group_ids: Sequence[int], step: int) -> list[list[int]]:
        """Each epoch's row order for step `step`'s updates (`group_order`, its shuffle seeded by the
        run's seed and the step); the updates are its train.minibatch_size slices in turn."""
        rng = random.Random(f"{self.cfg.seed}:minibatch:{step}")
        return [group_order(group_ids, rng) for _ in range(self.cfg.train.epochs)]

    def first_update_rows(self, group_ids: Sequence[int], step: int) -> list[int]:
        """The rows of step `step`'s first minibatch: its forward pass runs on the weights the step
        started from, so its own detached log-probs are pi_prox (`AdvantageStage`)."""
        return self.orders(group_ids, step)[0][:self.cfg.train.minibatch_size]

    def has_loss_terms(self, batch: Batch, rows: Tensor) -> bool:
        """Whether the minibatch `rows` of `batch` has a token any loss term reads: an action token,
        or an observation token of the observation loss. A minibatch without one makes no
        optimiser step (neither an update nor a skipped one): AdamW would move the weights on its
        zero gradient, by momentum and weight decay."""
        if bool(batch.action_mask[rows].any()):
            return True
        return (self.cfg.distill.observation_coef > 0 and batch.observation_mask is not None
                and bool(batch.observation_mask[rows].any()))

    def accumulate_gradients(self, inputs: UpdateInputs, rows: Tensor, record: TokenRecord | None = None,
                             own_prox: bool | None = None) -> MinibatchResult:
        """Backward of the minibatch `rows` of `inputs.batch`, in micro-batches.

        Gradients add up in the parameters' .grad (the caller zeroes them first) to those of one
        pass over the whole minibatch: each micro-batch's loss is scaled by `micro_batch_scale`.
        Rows are sorted by length within the minibatch and each micro-batch is cut to its own
        longest row; a row longer than perf.micro_batch_tokens runs alone. With `own_prox` (by
        default: when `inputs` has no proximal log-probs), each micro-batch's own detached
        log-probs are pi_prox (rows of the step's first update: `AdvantageStage`) and come back in
        the result.
        """
        algo, distill, batch = self.cfg.algo, self.cfg.distill, inputs.batch
        mask = batch.action_mask[rows]  # [b, T]
        minibatch_weights = aggregation_weights(mask, algo)  # [b, T]
        action_tokens = int(mask.sum())
        parts: list[tuple[dict[str, Tensor], float, float, bool]] = []
        own_logp: list[tuple[Tensor, int, Tensor]] = []
        teacher_logp: list[tuple[Tensor, int, Tensor]] = []
        keys = prefix_keys(self.cfg.perf, batch)
        observation_coef = 0.0 if batch.observation_mask is None else distill.observation_coef
        observed = batch.observation_mask[rows] if observation_coef > 0 else None  # type: ignore[index]
        observation_tokens = max(1, int(observed.sum())) if observed is not None else 1
        observation_nll = 0.0
        scored = mask if observed is None else mask | observed
        for plan in plan_passes(batch.input_ids[rows], batch.attention_mask[rows], self.cfg.perf.micro_batch_tokens,
                                keys=None if keys is None else keys[rows.cpu()], positions=scored):
            group, width = list(plan.rows), plan.width
            micro_rows = rows[torch.tensor(group, device=rows.device)]
            micro = take_rows(batch, micro_rows, width)
            scale = micro_batch_scale(minibatch_weights[group, :width], micro.action_mask, algo)
            with self.autocast():
                out = micro_logprobs(self.model, micro.input_ids, micro.attention_mask, plan, with_entropy=True,
                                     with_hidden=self.value_head is not None or self.loss_teacher is not None,
                                     positions=scored[group, :width], temperature=self.cfg.rollout.temperature)
            ref = None if inputs.ref_logp is None or algo.kl_in_reward else inputs.ref_logp[micro_rows, :width]
            if own_prox or inputs.prox_logp is None:
                prox = out["logp"].detach().to(batch.behaviour_logprobs.dtype)
                own_logp.append((micro_rows, width, prox))
            else:
                prox = inputs.prox_logp[micro_rows, :width]
            advantages = inputs.advantages[micro_rows, :width]
            loss, metrics = policy_objective(logp=out["logp"], old_logp=micro.behaviour_logprobs,
                                             advantages=advantages, mask=micro.action_mask, cfg=algo,
                                             ref_logp=ref, entropy=out["entropy"], prox_logp=prox)
            if record is not None:
                record.write(micro_rows, width, out["logp"], *token_view(
                    logp=out["logp"], old_logp=micro.behaviour_logprobs, advantages=advantages,
                    mask=micro.action_mask, cfg=algo, prox_logp=prox))
            if self.value_head is not None and inputs.old_values is not None:
                new_values = self.value_head(micro.input_ids, micro.attention_mask, out["hidden"])
                vloss, vmetrics = value_loss(new_values, inputs.old_values[micro_rows, :width],
                                             inputs.returns[micro_rows, :width], micro.action_mask, algo)
                loss = loss + algo.value_coef * vloss
                metrics.update(vmetrics)
            if self.loss_teacher is not None:
                assert inputs.teacher_view is not None  # a loss-form teacher views every batch
                dloss, dmetrics, sampled = self.distill_loss(self.loss_teacher, inputs.teacher_view, out["hidden"],
                                                             micro.input_ids, micro.action_mask, micro_rows)
                loss = loss + dloss
                metrics.update(dmetrics)
                teacher_logp.append((micro_rows, width, sampled.to(batch.behaviour_logprobs.dtype)))
            total = loss * scale
            if observed is not None:  # Echo: next-token loss on the observation tokens, minibatch token mean
                micro_observed = observed[group, :width]
                nll = -out["logp"].masked_fill(~micro_observed, 0.0).sum() / observation_tokens
                total = total + observation_coef * nll
                observation_nll += float(nll.detach())
            if not torch.isfinite(total):
                return MinibatchResult(None, len(parts) + 1, own_logp, teacher_logp)
            if total.requires_grad:  # a micro-batch without action tokens has no graph: nothing to add
                total.backward()
            micro_tokens = int(micro.action_mask.sum())
            parts.append((metrics, scale, micro_tokens / max(1, action_tokens), micro_tokens > 0))
        combined = combine_micro_metrics(parts)
        if observed is not None:
            combined["train/observation_nll"] = observation_nll
            combined["train/observation_tokens"] = float(observed.sum())
        return MinibatchResult(combined, len(parts), own_logp, teacher_logp)

    def distill_loss(self, teacher: Teacher, view: TeacherView, hidden: Tensor, input_ids: Tensor,
                     action_mask: Tensor, rows: Tensor) -> tuple[Tensor, dict[str, Tensor], Tensor]:
        """coef x the aggregated divergence between the student's and the teacher's next-token
        distributions at each action token of a micro-batch (distill.form=loss), its metrics, and
        the teacher's log-prob of each sampled action token ([b, t], 0 elsewhere; no gradient),
        read from the same logits."""
        cfg, algo = self.cfg.distill, self.cfg.algo
        student = head_logits(self.model, hidden, action_mask, self.cfg.rollout.temperature)  # [n, V]
        target = teacher.action_logits(view, rows)  # [n, V]
        if cfg.divergence == "reverse_kl":
            per_token = reverse_kl(student, target)
        elif cfg.divergence == "forward_kl":
            per_token = forward_kl(student, target, top_k=cfg.top_k or None)
        else:
            per_token = generalized_jsd(student, target, beta=cfg.beta)
        where = action_mask[:, 1:].nonzero(as_tuple=True)
        dense = torch.zeros(action_mask.shape, dtype=per_token.dtype, device=per_token.device)
        dense = dense.index_put((where[0], where[1] + 1), per_token)
        with torch.no_grad():
            picked = torch.log_softmax(target, dim=-1).gather(1, input_ids[where[0], where[1] + 1].unsqueeze(1))
            sampled = torch.zeros(action_mask.shape, dtype=picked.dtype, device=picked.device)
            sampled = sampled.index_put((where[0], where[1] + 1), picked.squeeze(1))
        loss = cfg.coef * aggregate(dense, action_mask, algo)
        count = max(1, per_token.numel())
        return loss, {"distill/loss": loss.detach(), "distill/kl": per_token.detach().sum() / count,
                      "distill/top_token_differs": top_token_disagreement(student.detach(), target).sum() / count}, \
            sampled

    # ----------------------------------------------------------------- supervised updates
    def sft_update(self, batch: Batch, optimizer: torch.optim.Optimizer) -> float:
        """One supervised update of the policy on `batch`'s action tokens (their token mean over
        the whole batch), in micro-batches as the RL updates; -> the loss."""
        action_tokens = batch.action_mask.sum().clamp(min=1)  # each micro-batch divides by the batch's count
        lengths = row_lengths(batch.attention_mask).tolist()
        optimizer.zero_grad(set_to_none=True)
        loss_value = 0.0
        for group in split_rows(lengths, self.cfg.perf.micro_batch_tokens):
            micro = take_rows(batch, torch.tensor(group, device=self.device), max(lengths[r] for r in group))
            with self.autocast():
                logp = token_logprobs(self.model, micro.input_ids, micro.attention_mask,
                                      positions=micro.action_mask)["logp"]
            loss = -(logp * micro.action_mask).sum() / action_tokens
            if loss.requires_grad:  # rows without action tokens: nothing to learn from
                loss.backward()
            loss_value += loss.item()
        torch.nn.utils.clip_grad_norm_(trainable_parameters(self.model), self.cfg.optim.max_grad_norm)
        optimizer.step()
        return loss_value
