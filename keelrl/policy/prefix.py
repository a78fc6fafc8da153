"""Learner passes that run a group's shared prompt once.

The rows of a GRPO group start with the same prompt (the task's first observation) and differ
only in what the policy then wrote. A plain pass runs that prompt once per row; in the default
coding run the prompt is ~185 of a row's ~210 tokens, so most of the learner's compute is the
same prompt four times over. Here each group's shared tokens run once (one batched pass over
every unit's prefix), their keys and values are copied to each row of the group, and only the
rows' own continuations run per row, attending to that cache. Gradients flow back into the
prefix through the copied keys and values, so the result and its gradients are those of the
plain pass (`token_logprobs`), up to floating-point summation order.

Layout. Prefixes are right-padded into [U, P] (P the longest cut); row r's continuation starts
at its unit's cut c_r and is right-padded into [B, C]. The continuation's attention mask is the
unit's prefix mask followed by its own, so the padding between a short prefix and its
continuation is masked like any other padding; rotary positions are given explicitly (c_r + j),
so a row sees the positions it has in the plain pass. No query row is ever fully masked (padding
sits after real tokens), so nothing produces NaN in the padding.

A unit shares tokens only before its first scored position: those positions' log-probs come
from the continuation pass, which starts one token before the first of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from keelrl.policy.model import logprobs_from_hidden, row_lengths, split_rows, token_logprobs


@dataclass(frozen=True)
class PrefixUnit:
    """Rows of a batch that start with the same `shared` tokens, none of which is scored."""

    rows: tuple[int, ...]
    shared: int

    @property
    def cut(self) -> int:
        """Tokens run once in the prefix pass: all shared tokens but the last, which starts
        the continuation (its hidden state predicts the first token after the prefix)."""
        return self.shared - 1


MIN_SHARED = 2
"""A unit shares at least this many tokens, so its prefix pass has at least one token."""


def find_prefix_units(input_ids: Tensor, attention_mask: Tensor, keys: Sequence[int] | Tensor,
                      positions: Tensor | None = None) -> list[PrefixUnit]:
    """Rows with the same key (a group id) -> units of rows that share their leading tokens.

    The shared length is checked on the tokens, not assumed from the key: it is the rows'
    common prefix, cut before the first position any of them scores (`positions` [B, T], True
    where a log-prob is wanted; position 0 is never scored). A key whose rows share fewer than
    MIN_SHARED tokens is split into one unit per row. Runs on the CPU, once per batch.
    """
    ids = input_ids.detach().cpu()
    batch, width = ids.shape
    lengths = row_lengths(attention_mask.detach().cpu()).tolist()
    if positions is None:
        first_scored = [1] * batch
    else:
        scored = positions.detach().cpu().bool().clone()
        scored[:, 0] = False
        first_scored = torch.where(scored, torch.arange(width), width).amin(dim=1).tolist()
    key_list = keys.tolist() if isinstance(keys, Tensor) else list(keys)
    if len(key_list) != batch:
        raise ValueError(f"{len(key_list)} keys for a batch of {batch} rows")
    by_key: dict[Any, list[int]] = {}
    for row, key in enumerate(key_list):
        by_key.setdefault(key, []).append(row)
    units: list[PrefixUnit] = []
    for rows in by_key.values():
        own = [min(first_scored[row], lengths[row]) for row in rows]
        shared = min(own)
        if len(rows) > 1:
            first = ids[rows[0]]
            for row in rows[1:]:
                span = min(shared, lengths[row])
                differs = (ids[row, :span] != first[:span]).nonzero()
                shared = min(shared, int(differs[0]) if differs.numel() else span)
        if len(rows) > 1 and shared < MIN_SHARED:
            units.extend(PrefixUnit((row,), own[i]) for i, row in enumerate(rows))
        else:
            units.append(PrefixUnit(tuple(rows), shared))
    return units


def _unit_cost(unit: PrefixUnit, lengths: Sequence[int]) -> tuple[int, int]:
    """(prefix tokens, the widest continuation) of one unit."""
    return unit.cut, max(lengths[row] for row in unit.rows) - unit.cut


def _padded_tokens(batch: Sequence[PrefixUnit], lengths: Sequence[int]) -> int:
    """A micro-batch's padded tokens: units x longest cut + rows x widest continuation."""
    costs = [_unit_cost(unit, lengths) for unit in batch]
    return len(batch) * max(c for c, _ in costs) + sum(len(unit.rows) for unit in batch) * max(w for _, w in costs)


def _split_unit(unit: PrefixUnit, lengths: Sequence[int], max_tokens: int, overhead: int | None) -> list[PrefixUnit]:
    """One unit's rows, widest continuation first, in parts that share its prefix.

    overhead None: as few parts as `max_tokens` allows, filled in order. Else the split that
    minimises the parts' padded tokens plus `overhead` a part, each part within the budget
    (a row alone may exceed it): rows of very different lengths then run in separate passes
    instead of padding the short ones to the longest (a dynamic programme over the sorted rows).
    """
    cut, _ = _unit_cost(unit, lengths)
    rows = sorted(unit.rows, key=lambda row: -lengths[row])
    widths = [lengths[row] - cut for row in rows]
    if overhead is None:
        parts = []
        while rows:
            take = max(1, (max_tokens - cut) // max(1, lengths[rows[0]] - cut))
            parts.append(PrefixUnit(tuple(rows[:take]), unit.shared))
            rows = rows[take:]
        return parts
    count = len(rows)
    best: list[float] = [0.0] + [math.inf] * count  # best[j]: the cheapest split of rows[:j]
    start = [0] * (count + 1)
    for end in range(1, count + 1):
        for begin in range(end):
            tokens = cut + (end - begin) * widths[begin]  # rows[begin] is the part's widest
            if tokens > max_tokens and end - begin > 1:
                continue
            total = best[begin] + tokens + overhead
            if total < best[end]:
                best[end], start[end] = total, begin
    bounds, end = [], count
    while end > 0:
        bounds.append((start[end], end))
        end = start[end]
    return [PrefixUnit(tuple(rows[begin:end]), unit.shared) for begin, end in reversed(bounds)]


def plan_micro_batches(units: Sequence[PrefixUnit], lengths: Sequence[int], max_tokens: int,
                       overhead: int | None = None) -> list[list[PrefixUnit]]:
    """Units packed into micro-batches whose padded tokens (units x longest cut + rows x
    widest continuation) stay within `max_tokens`; a unit too big on its own is split by rows
    (its parts still share the prefix), down to one row, which runs over budget if it must.

    Units go in order of continuation width, widest first, so similar widths share a batch.
    `overhead` (None: off) is what one more pass costs, in padded tokens: a unit is then split
    where that saves more padding than the passes cost (`_split_unit`), and a part joins the
    micro-batch before it only if that adds at most `overhead` padded tokens.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if overhead is not None and overhead < 0:
        raise ValueError(f"overhead must be >= 0 padded tokens, got {overhead}")
    parts = [part for unit in units for part in _split_unit(unit, lengths, max_tokens, overhead)]
    parts.sort(key=lambda unit: -_unit_cost(unit, lengths)[1])
    batches: list[list[PrefixUnit]] = []
    for unit in parts:
        if batches:
            trial = batches[-1] + [unit]
            tokens = _padded_tokens(trial, lengths)
            if tokens <= max_tokens and (overhead is None or tokens <= _padded_tokens(batches[-1], lengths)
                                         + _padded_tokens([unit], lengths) + overhead):
                batches[-1].append(unit)
                continue
        batches.append([unit])
    return batches


def localize(units: Sequence[PrefixUnit]) -> tuple[list[int], list[PrefixUnit]]:
    """The rows of `units`, in order, and the units renumbered to index that list."""
    rows: list[int] = []
    local = []
    for unit in units:
        local.append(PrefixUnit(tuple(range(len(rows), len(rows) + len(unit.rows))), unit.shared))
        rows.extend(unit.rows)
    return rows, local


def can_share(model: Any, units: Sequence[PrefixUnit]) -> bool:
    """Whether `prefix_token_logprobs` can run these units on `model`: every unit shares at
    least MIN_SHARED tokens, and no layer is checkpointed in this pass (a checkpointed layer
    replays its cache update in the backward pass)."""
    if not units or any(unit.shared < MIN_SHARED for unit in units):
        return False
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else "is_gradient_checkpointing"
    checkpointed = getattr(model, name, False) and model.training and torch.is_grad_enabled()
    return not checkpointed


def cache_kwarg(body: Any) -> str:
    """How a model body (`model.model`) and its `generate` take a KV cache: recent transformers
    call it `cache`, earlier versions `past_key_values` (deprecated, with a warning, since)."""
    import inspect

    return "cache" if "cache" in inspect.signature(body.forward).parameters else "past_key_values"


def returned_cache(output: Any) -> Any:
    """The KV cache a model body returned (`cache` in recent transformers, `past_key_values` before)."""
    return output["cache"] if "cache" in output else output["past_key_values"]


def prefix_token_logprobs(model: Any, input_ids: Tensor, attention_mask: Tensor, units: Sequence[PrefixUnit], *,
                          with_entropy: bool = False, with_hidden: bool = False,
                          positions: Tensor | None = None, temperature: float = 1.0) -> dict[str, Tensor]:
    """`token_logprobs` of a right-padded batch [B, T] whose rows are covered by `units`
    (each row in exactly one, every unit sharing >= MIN_SHARED tokens, see `can_share`).

    Same contract and results: {"logp": [B, T], "entropy": [B, T], "hidden": [B, T, H]}, with
    0 at position 0 and at padding. Differentiable: gradients reach every weight through
    both passes.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    device = input_ids.device
    batch, width = input_ids.shape
    covered = sorted(row for unit in units for row in unit.rows)
    if covered != list(range(batch)):
        raise ValueError(f"units cover rows {covered}; a batch of {batch} needs each row exactly once")
    if any(unit.shared < MIN_SHARED for unit in units):
        raise ValueError(f"every unit must share at least {MIN_SHARED} tokens (see can_share)")
    lengths = row_lengths(attention_mask)
    body = model.model

    # Prefix pass: each unit's first cut tokens, right-padded into [U, P].
    cuts = torch.tensor([unit.cut for unit in units], device=device)  # [U]
    longest_cut = max(unit.cut for unit in units)
    span = torch.arange(longest_cut, device=device)
    first_rows = torch.tensor([unit.rows[0] for unit in units], device=device)
    prefix_mask = (span.unsqueeze(0) < cuts.unsqueeze(1)).long()  # [U, P]
    prefix_ids = input_ids[first_rows, :longest_cut].masked_fill(prefix_mask == 0, 0)
    prefix = body(input_ids=prefix_ids, attention_mask=prefix_mask, use_cache=True)
    cache = returned_cache(prefix)

    # Continuation pass: row r from its unit's cut to its end, right-padded into [B, C].
    unit_of = torch.empty(batch, dtype=torch.long, device=device)
    for index, unit in enumerate(units):
        unit_of[list(unit.rows)] = index
    row_cut = cuts[unit_of]  # [B]
    widest = int((lengths - row_cut).max())
    offsets = torch.arange(widest, device=device)
    source = (row_cut.unsqueeze(1) + offsets).clamp(max=width - 1)  # [B, C] positions in the plain layout
    inside = offsets.unsqueeze(0) < (lengths - row_cut).unsqueeze(1)  # [B, C]
    rest_ids = input_ids.gather(1, source).masked_fill(~inside, 0)
    cache.batch_select_indices(unit_of)
    mask = torch.cat([prefix_mask[unit_of], inside.long()], dim=1)  # [B, P + C]
    rest = body(input_ids=rest_ids, attention_mask=mask, position_ids=source, use_cache=True,
                **{cache_kwarg(body): cache})
    hidden = rest.last_hidden_state  # [B, C, H]
    rest_positions = None if positions is None else positions.gather(1, source) & inside
    logp, entropy = logprobs_from_hidden(model, hidden, rest_ids, positions=rest_positions,
                                          with_entropy=with_entropy, temperature=temperature)

    # Back to the plain layout: continuation column j is position cut_r + j. Scatter into a
    # frame wide enough for every row, then keep the first T columns (the rest is padding).
    frame = longest_cut + widest
    column = row_cut.unsqueeze(1) + offsets  # [B, C], distinct within a row
    result = {"logp": logp.new_zeros(batch, frame).scatter(1, column, logp * inside)[:, :width]}
    if entropy is not None:
        result["entropy"] = entropy.new_zeros(batch, frame).scatter(1, column, entropy * inside)[:, :width]
    if with_hidden:
        size = hidden.shape[-1]
        tail = hidden.new_zeros(batch, frame, size).scatter(1, column.unsqueeze(-1).expand(-1, -1, size),
                                                            hidden * inside.unsqueeze(-1))
        head = prefix.last_hidden_state[unit_of]  # [B, P, H]
        head = torch.cat([head, head.new_zeros(batch, frame - longest_cut, size)], dim=1)
        before = (torch.arange(frame, device=device).unsqueeze(0) < row_cut.unsqueeze(1)).unsqueeze(-1)
        result["hidden"] = torch.where(before, head, tail)[:, :width]
    return result


@dataclass(frozen=True)
class MicroBatch:
    """One forward pass of a plan: `rows` of the batch, cut to `width`, run plainly or, with
    `units` (renumbered to index `rows`), by `prefix_token_logprobs`."""

    rows: tuple[int, ...]
    width: int
    units: tuple[PrefixUnit, ...] | None = None


def pass_overhead(device: torch.device) -> int | None:
    """What one more forward pass is worth in padded tokens when a plan splits a group's rows by
    length (`plan_micro_batches`): PASS_OVERHEAD_TOKENS on a CPU; None (no split for padding,
    the fewest passes the budget allows) elsewhere, where a pass's fixed cost was not measured."""
    return PASS_OVERHEAD_TOKENS if device.type == "cpu" else None


PASS_OVERHEAD_TOKENS = 64
"""A CPU forward pass's fixed cost, in padded tokens, that a split by length must save
(docs/measurements.md#passes-split-by-length)."""


def plan_passes(input_ids: Tensor, attention_mask: Tensor, max_tokens: int, *, keys: Sequence[int] | Tensor | None = None,
                positions: Tensor | None = None, overhead: int | None | str = "auto") -> list[MicroBatch]:
    """The micro-batches of one pass over a batch [B, T], each within `max_tokens` padded tokens.

    Without `keys`: rows grouped by `split_rows`, run plainly. With `keys` (group ids): rows
    whose key-mates share their leading tokens run by shared prefix (`plan_micro_batches`), so
    the budget counts each prefix once, and, with an `overhead` (auto: `pass_overhead` of the
    batch's device), a group's rows of very different lengths run in separate passes; rows that
    share nothing run plainly. Runs on the CPU.
    """
    if overhead == "auto":
        overhead = pass_overhead(input_ids.device)
    if isinstance(overhead, str):
        raise ValueError(f"overhead must be 'auto', None or a number of padded tokens, got {overhead!r}")
    lengths = row_lengths(attention_mask).cpu().tolist()
    if keys is None:
        return [MicroBatch(tuple(group), max(lengths[row] for row in group)) for group in split_rows(lengths, max_tokens)]
    units = find_prefix_units(input_ids, attention_mask, keys, positions)
    shared = [unit for unit in units if unit.shared >= MIN_SHARED]
    alone = [row for unit in units if unit.shared < MIN_SHARED for row in unit.rows]
    plan = []
    for units_of_batch in plan_micro_batches(shared, lengths, max_tokens, overhead):
        rows, local = localize(units_of_batch)
        plan.append(MicroBatch(tuple(rows), max(lengths[row] for row in rows), tuple(local)))
    for group in split_rows([lengths[row] for row in alone], max_tokens):
        plain = tuple(alone[index] for index in group)
        plan.append(MicroBatch(plain, max(lengths[row] for row in plain)))
    return plan


def micro_logprobs(model: Any, input_ids: Tensor, attention_mask: Tensor, micro: MicroBatch, **options: Any) -> dict[str, Tensor]:
    """`token_logprobs` of the micro-batch's rows (input_ids, attention_mask already cut to
    them and to micro.width), by shared prefix when the plan says so and the model can."""
    if micro.units is not None and can_share(model, micro.units):
        return prefix_token_logprobs(model, input_ids, attention_mask, micro.units, **options)
    return token_logprobs(model, input_ids, attention_mask, **options)


@torch.no_grad()
def chunked_token_logprobs(model: Any, input_ids: Tensor, attention_mask: Tensor, *, max_tokens: int,
                           value_fn: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None,
                           positions: Tensor | None = None, temperature: float = 1.0,
                           keys: Sequence[int] | Tensor | None = None,
                           hidden_at: Tensor | None = None) -> dict[str, Tensor]:
    """input_ids, attention_mask [B, T] -> {"logp": [B, T], "values": [B, T]}, without gradients.

    `token_logprobs` over groups of rows from `split_rows`, each cut to its own longest row,
    so no forward pass sees more than `max_tokens` padded tokens (a row longer than that
    runs alone). At padding positions the results are unspecified (0, or whatever the model
    makes of pad tokens), as in one pass over the whole batch: mask them. With `value_fn`
    (a critic: input_ids, attention_mask, hidden [b, t, H] -> values [b, t]) the values are
    computed group by group too, so the [B, T, H] hidden states never exist at once.
    `positions` and `temperature` as in `token_logprobs`. With `keys` (group ids) and
    `positions`, rows of a group that share a prompt run it once (`plan_passes`).
    With `hidden_at` ([B, T] bool) the hidden states there come back too, as "hidden_at"
    [n, H] in the order of `hidden_at.nonzero()` (row by row, left to right).
    """
    batch, length = input_ids.shape
    logp = torch.zeros(batch, length, dtype=torch.float32, device=input_ids.device)
    values: Tensor | None = None
    picked: list[tuple[Tensor, Tensor]] = []  # (flat index row * T + position, hidden [n, H])
    for micro in plan_passes(input_ids, attention_mask, max_tokens, keys=keys, positions=positions):
        rows, width = torch.tensor(micro.rows, device=input_ids.device), micro.width
        ids, attended = input_ids[rows, :width], attention_mask[rows, :width]  # [b, t]
        out = micro_logprobs(model, ids, attended, micro, with_hidden=value_fn is not None or hidden_at is not None,
                             positions=None if positions is None else positions[rows, :width],
                             temperature=temperature)
        logp = logp.to(out["logp"].dtype)  # float64 weights give float64 log-probs
        logp[rows, :width] = out["logp"]
        if value_fn is not None:
            group_values = value_fn(ids, attended, out["hidden"])  # [b, t]
            if values is None:
                values = group_values.new_zeros(batch, length)
            values[rows, :width] = group_values
        if hidden_at is not None:
            where = hidden_at[rows, :width].nonzero(as_tuple=True)
            picked.append((rows[where[0]] * length + where[1], out["hidden"][where]))
    result = {"logp": logp}
    if values is not None:
        result["values"] = values
    if hidden_at is not None:
        flat = torch.cat([index for index, _ in picked]) if picked else input_ids.new_zeros(0)
        hidden = torch.cat([h for _, h in picked]) if picked else logp.new_zeros(0, model.config.hidden_size)
        result["hidden_at"] = hidden[flat.argsort()]
    return result
