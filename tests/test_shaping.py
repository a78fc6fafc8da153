"""Per-turn rewards: potential-based shaping keeps the optimal policy (Ng, Harada and Russell
1999) where a bonus that is not a potential difference changes it, on a small MDP solved exactly;
the coding environment's shaping on the lecture's trajectory, turn by turn against hand-counted
visible tests; and the per-turn rewards reaching the advantages at their turns' last tokens."""

from __future__ import annotations

import shutil

import pytest
import torch

from keelrl.algos import compute_advantages, outcome_to_token_rewards
from keelrl.algos.config import AlgoConfig
from keelrl.envs.coding import CodingEnv
from keelrl.envs.shaping import shaping_reward
from keelrl.rollout.trajectory import Trajectory, collate
from task_fixtures import retry_task

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")

# -- a small MDP: fix a bug, with a test tool that does nothing --------------------------------
#
# States 0 (buggy), 1 (half fixed), 2 (fixed); the end state is absorbing. Actions:
#   edit:   0 -> 1 -> 2 -> 2 (an edit of fixed code changes nothing)
#   test:   stays (reads the state, changes nothing)
#   submit: ends the episode with reward 1 from state 2, 0 otherwise.
# Each turn costs `step_cost`; gamma < 1 makes finishing sooner better. The unshaped optimum is
# edit, edit, submit. A potential phi(s) = visible tests passed (0, 0.5, 1) shapes it without
# changing it; a test bonus (+b for each `test`, not a potential difference) makes testing
# forever better than ever submitting.

STATES, ACTIONS, END = (0, 1, 2), ("edit", "test", "submit"), "end"
GAMMA, STEP_COST = 0.9, 0.01
PHI = {0: 0.0, 1: 0.5, 2: 1.0, END: 0.0}


def transition(state: int, action: str) -> tuple[object, float]:
    """(next state, reward) of the unshaped MDP."""
    if action == "edit":
        return min(state + 1, 2), -STEP_COST
    if action == "test":
        return state, -STEP_COST
    return END, (1.0 if state == 2 else 0.0) - STEP_COST


def solve(reward_of) -> dict[int, str]:
    """Greedy policy from value iteration (float64, to convergence) under `reward_of(s, a, s', r)`."""
    value = {state: 0.0 for state in STATES}
    value[END] = 0.0
    for _ in range(2000):
        new = {state: max(reward_of(state, action, *transition(state, action))
                          + GAMMA * value[transition(state, action)[0]] for action in ACTIONS) for state in STATES}
        new[END] = 0.0
        if max(abs(new[s] - value[s]) for s in STATES) < 1e-13:
            break
        value = new
    return {state: max(ACTIONS, key=lambda a: reward_of(state, a, *transition(state, a))
                       + GAMMA * value[transition(state, a)[0]]) for state in STATES}


def unshaped(state, action, following, reward):
    return reward


def potential_shaped(state, action, following, reward):
    return reward + shaping_reward(PHI[state], PHI[following], following == END, GAMMA)


def bonus_for_tests(state, action, following, reward):
    return reward + (0.2 if action == "test" else 0.0)


def test_potential_shaping_keeps_the_optimal_policy_and_a_test_bonus_changes_it():
    best = solve(unshaped)
    assert best == {0: "edit", 1: "edit", 2: "submit"}
    assert solve(potential_shaped) == best
    # The bonus is worth 0.2 / (1 - 0.9) = 2 from testing forever, more than submitting's 1.
    assert solve(bonus_for_tests) == {0: "test", 1: "test", 2: "test"}


def test_shaping_adds_the_same_constant_to_every_episode_from_a_state():
    """Along any path from s0, the shaping terms sum to gamma^T phi(end) - phi(s0) = -phi(s0)."""
    for path in (["edit", "edit", "submit"], ["test", "edit", "test", "edit", "submit"], ["submit"],
                 ["edit", "submit"]):
        state, total, discount = 0, 0.0, 1.0
        for action in path:
            following, _ = transition(state, action)
            total += discount * shaping_reward(PHI[state], PHI[following], following == END, GAMMA)
            state, discount = following, discount * GAMMA
        assert total == pytest.approx(-PHI[0], abs=1e-12)


def test_shaping_reward_is_gamma_phi_after_minus_phi_before_with_zero_at_the_end():
    assert shaping_reward(0.25, 0.75, False) == 0.5
    assert shaping_reward(0.25, 0.75, False, gamma=0.5) == 0.125
    assert shaping_reward(0.25, 0.75, True) == -0.25


# -- the coding environment ---------------------------------------------------------------------

WRONG_LINE = '    return config.get("retries", 3)'
FIX_LINES = '    value = config.get("retries")\n    return 3 if value is None else value'


@needs_git
def test_coding_shaping_on_the_lectures_trajectory():
    """retry_count's visible tests: the base passes 3 of 4 (0 fails), the wrong fix 3 of 4 (None
    fails), the fix 4 of 4. With shaping 2, phi = 2 x the share: 1.5, 1.5, 2."""
    env = CodingEnv(use_git=False, shaping=2.0, malformed_cost=0.1)
    env.reset(retry_task())
    rewards = []
    for action, expected in (("<call>read</call>", {"tool": "read", "reward": 0.0}),
                             ("<call>replace 2\n" + WRONG_LINE + "</call>",
                              {"tool": "replace", "visible_passed": 3, "visible_total": 4, "reward": 0.0}),
                             ("<call>test</call>", {"tool": "test", "tests_passed": 3, "tests_failed": 1,
                                                    "reward": 0.0}),
                             ("<call>nonsense</call>", None),
                             (f"<call>edit\n{WRONG_LINE}\n>>>\n{FIX_LINES}</call>",
                              {"tool": "edit", "visible_passed": 4, "visible_total": 4, "reward": 0.5}),
                             ("<call>submit</call>", {"tool": "submit", "termination": "submitted", "reward": -2.0})):
        _, _, info = env.step(action)
        if expected is None:
            assert info["error"] and info["reward"] == pytest.approx(-0.1)
        else:
            assert info == expected
        rewards.append(info["reward"])
    assert sum(rewards) == pytest.approx(-1.5 - 0.1)  # -phi(base) - one malformed action
    assert env.grade().success


def test_an_edited_test_file_earns_no_shaping():
    env = CodingEnv(use_git=False, shaping=1.0)
    task = retry_task()
    env.reset(task)
    old = task.files["test_retry.py"].rstrip("\n")
    _, _, info = env.step(f"<call>edit test_retry.py\n{old}\n>>>\ndef test_ok():\n    pass\n</call>")
    assert info["visible_passed"] == 3 and info["reward"] == 0.0  # the task's own tests, as before


def test_an_edit_on_the_last_turn_gets_minus_the_potential_it_started_from():
    env = CodingEnv(use_git=False, shaping=1.0, max_turns=1)
    env.reset(retry_task())
    _, done, info = env.step(f"<call>replace 2\n{FIX_LINES}</call>")
    assert done and info["termination"] == "max_turns" and info["reward"] == pytest.approx(-0.75)


def test_no_rewards_in_info_without_shaping_or_a_cost():
    env = CodingEnv(use_git=False)
    env.reset(retry_task())
    assert "reward" not in env.step("<call>nonsense</call>")[2]


@pytest.mark.parametrize("name", ["shaping", "malformed_cost"])
def test_negative_shaping_settings_are_refused(name):
    with pytest.raises(ValueError, match=name):
        CodingEnv(**{name: -1.0})


# -- per-turn rewards reach the advantages ---------------------------------------------------

def test_turn_rewards_sit_on_each_turns_last_action_token_and_enter_reward_to_go():
    trajectory = Trajectory("t", 0)
    trajectory.extend([1, 2], action=False, turn=0)  # prompt
    trajectory.extend([3, 4], action=True, turn=0, logprobs=[0.0, 0.0])
    trajectory.extend([5], action=False, turn=0)  # observation
    trajectory.extend([6, 7, 8], action=True, turn=1, logprobs=[0.0] * 3)
    trajectory.prompt_length = 2
    trajectory.actions, trajectory.observations = ["a", "b"], ["o", "p"]
    trajectory.turn_info = [{"tool": "edit", "reward": 0.25}, {"tool": "submit", "reward": -1.0}]
    trajectory.reward = 1.0
    batch = collate([trajectory], pad_id=0)
    assert batch.step_rewards is not None
    assert batch.step_rewards[0].tolist() == [0, 0, 0, 0.25, 0, 0, 0, -1.0]
    token_rewards = outcome_to_token_rewards(batch.rewards, batch.action_mask) + batch.step_rewards
    cfg = AlgoConfig(preset="reinforce", advantage="reward_to_go", level="turn", gamma=1.0)
    out = compute_advantages(token_rewards=token_rewards, mask=batch.action_mask, group_ids=batch.group_ids,
                             cfg=cfg, values=None, turn_ids=batch.turn_ids)
    # Turn 0: 0.25 + (-1 + 1); turn 1: -1 + 1 = 0; every token of a turn carries its turn's value.
    assert out.advantages[0].tolist() == pytest.approx([0, 0, 0.25, 0.25, 0, 0, 0, 0])
    assert torch.equal(batch.step_rewards[~batch.action_mask], torch.zeros(3))
