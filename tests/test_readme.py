"""README's code and commands stay true."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def test_readme_python_example_runs_and_backpropagates():
    blocks = re.findall(r"```python\n(.*?)```", README, re.DOTALL)
    assert blocks, "README has no python example"
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    logp, metrics = namespace["logp"], namespace["metrics"]
    assert logp.grad is not None and logp.grad.abs().sum() > 0
    assert {"policy/clip_frac_low", "policy/clip_frac_high", "policy/is_weight_max"} <= set(metrics)
    # The success of the group of four gets the positive advantage.
    assert namespace["adv"].advantages[0, 1] > 0 > namespace["adv"].advantages[1, 1]


def test_ci_runs_exactly_the_readme_test_command():
    ci = (REPO / ".ci" / "run").read_text()
    readme_command = "python -m pytest -q && bash .ci/vllm"
    assert f"&& {readme_command}\n" in README
    last_command = [line for line in ci.splitlines() if line.strip() and not line.startswith("#")][-1]
    assert last_command.strip() == readme_command
