"""Slow float64 references for keelrl.algos.ratios and keelrl.algos.losses.

Plain Python loops over nested lists of floats, written straight from the formulas in the
module docstrings, sharing no code with the library. Each function takes lists (use
`tensor.tolist()`) and returns lists or floats. Gradients are written out analytically
(chain rule by hand), so a test can compare them with torch.autograd on the fast path.
"""

from __future__ import annotations

import math

Grid = list[list[float]]
Mask = list[list[bool]]


def _clamp(x: float, low: float, high: float) -> float:
    return min(max(x, low), high)


# ---------------------------------------------------------------------------- ratios

def log_weights(name: str, logp: Grid, old_logp: Grid, mask: Mask) -> Grid:
    """The log of each ratio before clamping; 0.0 at observation tokens (never used there)."""
    out: Grid = []
    for lp_row, olp_row, m_row in zip(logp, old_logp, mask):
        token_lr = [lp - olp if m else 0.0 for lp, olp, m in zip(lp_row, olp_row, m_row)]
        n = sum(1 for m in m_row if m)
        total = 0.0
        for x, m in zip(token_lr, m_row):
            if m:
                total += x
        row: list[float] = []
        running = 0.0
        for x, m in zip(token_lr, m_row):
            if m:
                running += x
            if not m:
                row.append(0.0)
            elif name == "token":
                row.append(x)
            elif name in ("sequence", "sequence_token"):
                row.append(total / n)
            elif name == "cumulative":
                row.append(total)
            elif name == "ctpo":
                row.append(running)
            else:
                raise KeyError(name)
        out.append(row)
    return out


def ratio(name: str, logp: Grid, old_logp: Grid, mask: Mask, max_log_ratio: float) -> Grid:
    """Ratio values [B][T]: exp(clamped log weight) at action tokens, exactly 1 elsewhere."""
    lw = log_weights(name, logp, old_logp, mask)
    return [[math.exp(_clamp(x, -max_log_ratio, max_log_ratio)) if m else 1.0
             for x, m in zip(lw_row, m_row)] for lw_row, m_row in zip(lw, mask)]


def ratio_jacobian(name: str, logp: Grid, old_logp: Grid, mask: Mask,
                   max_log_ratio: float) -> dict[tuple[int, int, int], float]:
    """d ratio[b][t] / d logp[b][s] for every (b, t, s) with a nonzero value.

    token, sequence_token, ctpo: r_t at s == t only; sequence: r_t / n at every action s of
    the row; cumulative: r_t at every action s of the row. Zero where the log weight was
    clamped (clamp has no gradient outside its range).
    """
    lw = log_weights(name, logp, old_logp, mask)
    r = ratio(name, logp, old_logp, mask, max_log_ratio)
    jac: dict[tuple[int, int, int], float] = {}
    for b, m_row in enumerate(mask):
        n = sum(1 for m in m_row if m)
        for t, m in enumerate(m_row):
            if not m or abs(lw[b][t]) > max_log_ratio:
                continue
            for s, ms in enumerate(m_row):
                if not ms:
                    continue
                if name in ("token", "sequence_token", "ctpo"):
                    if s == t:
                        jac[(b, t, s)] = r[b][t]
                elif name == "sequence":
                    jac[(b, t, s)] = r[b][t] / n
                elif name == "cumulative":
                    jac[(b, t, s)] = r[b][t]
    return jac


# ---------------------------------------------------------------------------- aggregation

def aggregation_weights(mode: str, mask: Mask, agg_constant: int | None) -> Grid:
    """d loss / d per_token[b][t] for each aggregation mode (0 off the mask)."""
    batch = len(mask)
    total_tokens = sum(1 for row in mask for m in row if m)
    rows_with_tokens = sum(1 for row in mask if any(row))
    out: Grid = []
    for row in mask:
        n = sum(1 for m in row if m)
        w: list[float] = []
        for m in row:
            if not m:
                w.append(0.0)
            elif mode == "token_mean":
                w.append(1.0 / total_tokens)
            elif mode == "seq_mean_token_mean":
                w.append(1.0 / (n * rows_with_tokens))
            elif mode == "seq_mean_token_sum":
                w.append(1.0 / batch)
            elif mode == "constant":
                assert agg_constant is not None
                w.append(1.0 / (batch * agg_constant))
            else:
                raise KeyError(mode)
        out.append(w)
    return out


def aggregate(mode: str, per_token: Grid, mask: Mask, agg_constant: int | None) -> float:
    """Scalar loss from per-token values, looping the way each mode is defined."""
    batch = len(mask)
    if mode == "token_mean":
        total, count = 0.0, 0
        for v_row, m_row in zip(per_token, mask):
            for v, m in zip(v_row, m_row):
                if m:
                    total += v
                    count += 1
        return total / count if count else 0.0
    if mode == "seq_mean_token_mean":
        means = []
        for v_row, m_row in zip(per_token, mask):
            vals = [v for v, m in zip(v_row, m_row) if m]
            if vals:
                means.append(sum(vals) / len(vals))
        return sum(means) / len(means) if means else 0.0
    if mode == "seq_mean_token_sum":
        sums = [sum(v for v, m in zip(v_row, m_row) if m) for v_row, m_row in zip(per_token, mask)]
        return sum(sums) / batch
    if mode == "constant":
        total = sum(v for v_row, m_row in zip(per_token, mask) for v, m in zip(v_row, m_row) if m)
        assert agg_constant is not None
        return total / (batch * agg_constant)
    raise KeyError(mode)


def masked_mean(values: Grid, mask: Mask) -> float:
    vals = [v for v_row, m_row in zip(values, mask) for v, m in zip(v_row, m_row) if m]
    return sum(vals) / len(vals) if vals else 0.0


def masked_max(values: Grid, mask: Mask) -> float:
    vals = [v for v_row, m_row in zip(values, mask) for v, m in zip(v_row, m_row) if m]
    return max(vals) if vals else 0.0


def masked_min(values: Grid, mask: Mask) -> float:
    vals = [v for v_row, m_row in zip(values, mask) for v, m in zip(v_row, m_row) if m]
    return min(vals) if vals else 0.0


# ---------------------------------------------------------------------------- policy losses

def policy_loss(clip: str, ratio_name: str, logp: Grid, old_logp: Grid, advantages: Grid,
                mask: Mask, *, eps_low: float, eps_high: float, dual_clip_c: float,
                tis_cap: float, aggregation: str, agg_constant: int | None,
                max_log_ratio: float) -> tuple[float, dict[str, float], Grid]:
    """-> (loss, metrics, d loss / d logp [B][T]) for one clip rule and one ratio."""
    low, high = 1.0 - eps_low, 1.0 + eps_high
    r = ratio(ratio_name, logp, old_logp, mask, max_log_ratio)
    jac = ratio_jacobian(ratio_name, logp, old_logp, mask, max_log_ratio)
    agg_w = aggregation_weights(aggregation, mask, agg_constant)
    batch, length = len(mask), len(mask[0])

    per_token: Grid = [[0.0] * length for _ in range(batch)]
    d_ratio: Grid = [[0.0] * length for _ in range(batch)]  # d per_token / d ratio (ppo-like)
    d_logp_direct: Grid = [[0.0] * length for _ in range(batch)]  # d per_token / d own logp
    clip_low: Grid = [[0.0] * length for _ in range(batch)]
    clip_high: Grid = [[0.0] * length for _ in range(batch)]
    dual_active: Grid = [[0.0] * length for _ in range(batch)]
    for b in range(batch):
        for t in range(length):
            if not mask[b][t]:
                continue
            rt, a, lp = r[b][t], advantages[b][t], logp[b][t]
            if clip in ("ppo", "dual_clip"):
                unclipped, clipped = rt * a, _clamp(rt, low, high) * a
                per_token[b][t] = -min(unclipped, clipped)
                clipped_wins = (a > 0 and rt > high) or (a < 0 and rt < low)
                d_ratio[b][t] = 0.0 if clipped_wins else -a
                clip_low[b][t] = float(rt < low and a < 0)
                clip_high[b][t] = float(rt > high and a > 0)
                if clip == "dual_clip" and a < 0:
                    cap = -dual_clip_c * a
                    if cap < per_token[b][t]:
                        per_token[b][t] = cap
                        d_ratio[b][t] = 0.0
                        dual_active[b][t] = 1.0
            elif clip == "cispo":
                weight = _clamp(rt, low, high)
                per_token[b][t] = -weight * a * lp
                d_logp_direct[b][t] = -weight * a
                clip_low[b][t] = float(rt < low)
                clip_high[b][t] = float(rt > high)
            elif clip == "tis":
                weight = min(rt, tis_cap)
                per_token[b][t] = -weight * a * lp
                d_logp_direct[b][t] = -weight * a
                clip_high[b][t] = float(rt > tis_cap)
            elif clip == "none":
                per_token[b][t] = -rt * a
                d_ratio[b][t] = -a
            else:
                raise KeyError(clip)

    loss = aggregate(aggregation, per_token, mask, agg_constant)

    grad: Grid = [[0.0] * length for _ in range(batch)]
    for b in range(batch):
        for t in range(length):
            grad[b][t] += agg_w[b][t] * d_logp_direct[b][t]
    for (b, t, s), j in jac.items():
        grad[b][s] += agg_w[b][t] * d_ratio[b][t] * j

    token_lr = [[lp - olp if m else 0.0 for lp, olp, m in zip(lp_row, olp_row, m_row)]
                for lp_row, olp_row, m_row in zip(logp, old_logp, mask)]
    # the metric clamps log-ratios like the weights, so it stays finite in float32
    token_lr = [[_clamp(x, -max_log_ratio, max_log_ratio) for x in row] for row in token_lr]
    approx_kl = [[math.expm1(x) - x for x in row] for row in token_lr]
    clipped = [[max(lo, hi) for lo, hi in zip(lo_row, hi_row)] for lo_row, hi_row in zip(clip_low, clip_high)]
    metrics = {
        "policy/loss": loss,
        "policy/clip_frac": masked_mean(clipped, mask),
        "policy/clip_frac_low": masked_mean(clip_low, mask),
        "policy/clip_frac_high": masked_mean(clip_high, mask),
        "policy/is_weight_mean": masked_mean(r, mask),
        "policy/is_weight_max": masked_max(r, mask),
        "policy/is_weight_min": masked_min(r, mask),
        "policy/approx_kl": masked_mean(approx_kl, mask),
    }
    if clip == "dual_clip":
        metrics["policy/dual_clip_frac"] = masked_mean(dual_active, mask)
    return loss, metrics, grad


# ---------------------------------------------------------------------------- KL estimators

def kl_estimate(estimator: str, lp: float, ref_lp: float) -> tuple[float, float]:
    """-> (per-token estimate of KL(pi || ref), its derivative w.r.t. lp)."""
    x = ref_lp - lp  # log(ref / pi)
    if estimator == "k1":
        return -x, 1.0
    if estimator == "k2":
        return 0.5 * x * x, -x
    if estimator == "k3":
        return math.expm1(x) - x, 1.0 - math.exp(x)
    raise KeyError(estimator)


# ---------------------------------------------------------------------------- value loss

def value_loss(values: Grid, old_values: Grid, returns: Grid, mask: Mask, *,
               value_clip: float | None, aggregation: str,
               agg_constant: int | None) -> tuple[float, dict[str, float], Grid]:
    """-> (loss, metrics, d loss / d values) for the (optionally clipped) critic loss."""
    batch, length = len(mask), len(mask[0])
    agg_w = aggregation_weights(aggregation, mask, agg_constant)
    per_token: Grid = [[0.0] * length for _ in range(batch)]
    squared: Grid = [[0.0] * length for _ in range(batch)]
    clipped_flag: Grid = [[0.0] * length for _ in range(batch)]
    grad: Grid = [[0.0] * length for _ in range(batch)]
    for b in range(batch):
        for t in range(length):
            if not mask[b][t]:
                continue
            v, v_old, ret = values[b][t], old_values[b][t], returns[b][t]
            se = (v - ret) ** 2
            squared[b][t] = se
            if value_clip is None:
                per_token[b][t] = 0.5 * se
                d = v - ret
            else:
                delta = v - v_old
                v_clipped = v_old + _clamp(delta, -value_clip, value_clip)
                ce = (v_clipped - ret) ** 2
                if ce > se:
                    per_token[b][t] = 0.5 * ce
                    clipped_flag[b][t] = 1.0
                    d = (v_clipped - ret) if abs(delta) <= value_clip else 0.0
                else:
                    per_token[b][t] = 0.5 * se
                    d = v - ret
            grad[b][t] = agg_w[b][t] * d
    loss = aggregate(aggregation, per_token, mask, agg_constant)
    metrics = {
        "value/loss": loss,
        "value/mse": masked_mean(squared, mask),
        "value/clip_frac": masked_mean(clipped_flag, mask),
        "value/mean": masked_mean(values, mask),
    }
    return loss, metrics, grad


# ---------------------------------------------------------------------------- entropy

def entropy(logits: list[float]) -> float:
    """Entropy of softmax(logits) for one position, the textbook way."""
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    z = sum(exps)
    probs = [e / z for e in exps]
    return -sum(p * math.log(p) for p in probs if p > 0.0)
