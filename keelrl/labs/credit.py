"""Lab credit: on the guessing game, critic + turn-level GAE vs GRPO group credit: learning speed,
and the per-turn advantages of a failed episode that had a good turn."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

from keelrl.labs.common import (LabResult, first, last, markdown_table, mean, plot_variants, series,
                                steps_run, train_variants)

def _turn_table(trajectory: Any, advantages: dict[str, Any]) -> list[dict[str, Any]]:
    """Per turn of one trajectory: its guess, whether it was the midpoint, each method's mean advantage."""
    import torch

    from keelrl.envs.guess import interval_after

    turn_ids = torch.tensor(trajectory.turn_ids)
    action = torch.tensor(trajectory.action_mask)
    rows: list[dict[str, Any]] = []
    history: list[tuple[int, str]] = []
    for turn, (text, observation) in enumerate(zip(trajectory.actions, trajectory.observations)):
        low, high = interval_after(16, history)
        try:
            guess = int(text.strip().removeprefix("<call>guess ").removesuffix("</call>"))
        except ValueError:
            guess = None
        where = action & (turn_ids == turn)
        row = {"turn": turn, "action": text.strip()[:40], "answer": observation[:20],
               "midpoint_guess": guess == (low + high) // 2 if guess is not None else False}
        for name, adv in advantages.items():
            row[name] = float(adv[where].mean()) if bool(where.any()) else float("nan")
        rows.append(row)
        if guess is not None:
            history.append((guess, observation))
    return rows


def lab_credit(out: Path, overrides: Sequence[str], quick: bool, progress: Callable[[str], None]) -> LabResult:
    """Critic + turn-level GAE vs GRPO group credit on the guessing game."""

    from keelrl.algos import AlgoConfig, compute_advantages, outcome_to_token_rewards
    from keelrl.rollout.trajectory import collate

    steps = 2 if quick else 15
    settings = list(overrides)
    common = [f"train.steps={steps}", f"eval.every={max(1, steps // 3)}"]
    variants = {"grpo": ["algo.preset=grpo", *common],
                "critic-turn-gae": ["algo.preset=ppo", "algo.level=turn", "algo.lam=0.9", "model.critic=head",
                                    *common]}
    trainers: dict[str, Any] = {}
    runs = train_variants(out, variants, settings, progress, trainers)
    steps = steps_run(runs)
    chart = plot_variants(out / "credit.png", runs, [("train/reward", "training success rate"),
                                                     ("eval/success", "held-out success (greedy)")],
                          "Credit assignment on the guessing game")
    progress("looking for a failed episode with a good turn")
    critic = trainers["critic-turn-gae"]
    engine = critic.make_engine()
    engine.start(critic.step)
    example: list[dict[str, Any]] = []
    for attempt in range(6):
        if attempt:  # the same weights under the next version, so the next step's requests may start
            engine.publish_model(critic.model, critic.step + attempt)
        trajectories = engine.batch(critic.step + 1 + attempt).trajectories
        batch = collate(trajectories, critic.pad_id).to(critic.device)
        critic_adv = critic._advantages(batch)[0].cpu()
        grpo = compute_advantages(token_rewards=outcome_to_token_rewards(batch.rewards, batch.action_mask),
                                  mask=batch.action_mask, group_ids=batch.group_ids,
                                  cfg=AlgoConfig(preset="grpo")).advantages.cpu()
        for row, t in enumerate(trajectories):
            if t.success:
                continue
            n = len(t.token_ids)
            table = _turn_table(t, {"grpo": grpo[row, :n], "critic_turn_gae": critic_adv[row, :n]})
            if any(r["midpoint_guess"] for r in table[:-1]) or (any(r["midpoint_guess"] for r in table) and not example):
                example = table
                group_rewards = [u.reward for u in trajectories if u.group_id == t.group_id]
                if any(r["midpoint_guess"] for r in table[:-1]) and max(group_rewards) > 0:
                    break
        else:
            continue
        break
    engine.close()
    numbers: dict[str, Any] = {label: {"reward_first": first(rows, "train/reward"),
                                       "reward_last3": mean([v for _, v in series(rows, "train/reward")[-3:]]),
                                       "eval_before": first(rows, "eval/success"),
                                       "eval_after": last(rows, "eval/success")}
                               for label, rows in runs.items()}
    numbers["failed_episode_turns"] = example
    signs = ""
    if example:
        signs = markdown_table(["turn", "action", "answer", "midpoint guess", "GRPO advantage", "critic + turn GAE"],
                               [(r["turn"], r["action"], r["answer"], r["midpoint_guess"], r["grpo"], r["critic_turn_gae"])
                                for r in example])
    summary = "\n".join([
        "# Lab: credit assignment", "",
        f"The guessing game (1..16, 5 guesses), warm-started on a teacher that guesses at random 60% of the time, "
        f"then {steps} RL steps of GRPO (group credit: every token of an episode shares its outcome's advantage) "
        f"or PPO with a value head and turn-level GAE (lambda 0.9: each turn is credited by how the critic's "
        f"estimate moved).", "",
        markdown_table(["variant", "train success first", "train success (last 3)", "held-out before", "held-out after"],
                       [(k, v["reward_first"], v["reward_last3"], v["eval_before"], v["eval_after"])
                        for k, v in numbers.items() if k != "failed_episode_turns"]), "",
        "A failed episode from the trained critic policy, per turn (mean advantage over the turn's tokens); "
        "a midpoint guess is the binary-search move:", "",
        signs or "(no failed episode found in the sampled batches)", "",
        "GRPO gives every turn of a failed episode the same sign; turn-level GAE can credit a good turn "
        "inside a failed episode when the critic's value rose after it.", "", f"Chart: {chart.name}"])
    return LabResult("credit", numbers, summary, [chart])
