"""Hand-written fixtures: the lecture's retry_count task (independent of the task generator)
and a binary-search policy for the 1..16 guessing game."""

from keelrl.envs.tasks import Check, Task, render_test_file

CHECKS = [
    Check("missing", [{}], 3),
    Check("none", [{"retries": None}], 3),
    Check("zero", [{"retries": 0}], 0, key=True),
    Check("two", [{"retries": 2}], 2),
]
BUGGY = 'def retry_count(config):\n    return config.get("retries") or 3\n'
FIXED = ('def retry_count(config):\n    value = config.get("retries")\n    if value is None:\n'
         '        return 3\n    return value\n')
WRONG = 'def retry_count(config):\n    return config.get("retries", 3)\n'
# Behaviourally equal to FIXED, worded differently (no "is None"): the brittle verifier's victim.
REWRITE = 'def retry_count(config):\n    value = config.get("retries")\n    return 3 if value == None else value\n'
CONSTANT_ZERO = "def retry_count(config):\n    return 0\n"


def retry_task() -> Task:
    return Task(
        id="retry_count", kind="falsy_or_default",
        prompt="retries=0 must disable retries; missing, None and positive values keep their behaviour.",
        files={"retry.py": BUGGY, "test_retry.py": render_test_file("retry", "retry_count", CHECKS)},
        entry_file="retry.py", entry_function="retry_count", test_file="test_retry.py",
        visible_tests=list(CHECKS), hidden_checks=list(CHECKS), reference_fix={"retry.py": FIXED},
        wrong_fix={"retry.py": WRONG}, brittle_phrase="is None")


def binary_search_guess(prompt, turns):
    """Policy for the 1..16 guessing game: halve the interval after each higher/lower."""
    from keelrl.envs.guess import BinarySearchTeacher, GuessTask

    return BinarySearchTeacher().policy(GuessTask("any", 1, 16))(prompt, turns)
