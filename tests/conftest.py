"""Setup the tests share: hypothesis and torch settings, the tiny models' specs, a saved tiny model
directory and the overrides that make a training run quick. Tests import the constants and helpers
as `from conftest import SMALL, FAST_RUN, ...`; pytest finds the fixtures by name."""

import io
import os
import signal
import subprocess
import sys
import tempfile
from contextlib import redirect_stderr, redirect_stdout

# One thread for the torch of every subprocess a test starts too (`keel` runs, bench smoke runs),
# for the reason below torch.set_num_threads(1).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# precision measurements (eval.dtype=auto) go to a directory of this session, never the user's cache
os.environ.setdefault("KEELRL_PRECISION_CACHE", tempfile.mkdtemp(prefix="keel-precision-"))
# and the labs' warm-started students (keelrl.labs.common.cached_student) too
os.environ.setdefault("KEELRL_STUDENT_CACHE", tempfile.mkdtemp(prefix="keel-students-"))

from dataclasses import replace
from pathlib import Path

import pytest
import torch  # after OMP_NUM_THREADS is set
from hypothesis import settings

from keelrl.rollout.scheduler import EpisodeLimits
from keelrl.policy.tiny import TinyModelSpec, build_tiny_model, build_tiny_tokenizer, save_tiny_default

# Deterministic examples under CI (CI=true), fresh ones on a developer's machine.
settings.register_profile("keel", deadline=None, derandomize=os.environ.get("CI") == "true")
settings.load_profile("keel")

# One torch thread: beside other busy processes (CI's load, or the two CPU hogs the suite must
# also finish beside), a second thread spins at every parallel region waiting for a descheduled
# peer; alone, one thread costs little (docs/measurements.md#torch-threads-in-the-tests).
torch.set_num_threads(1)


def available_devices() -> list[str]:
    """CPU always; CUDA as well where a GPU is present, so the GPU path runs wherever it can."""
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


SMALL = TinyModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, max_positions=2048)
"""The tiny model the training tests run (saved once as `tiny_model_dir`). tests/golden_runs.py
keeps its own copy: the golden files were recorded with it and must not move with this one."""

FLOAT64 = TinyModelSpec(layers=2, hidden=32, heads=4, kv_heads=2, intermediate=48, max_positions=64)
"""The smaller in-memory model of the float64 reference tests (`float64_model`)."""

FAST_RUN = ("warm_start.demos=4", "warm_start.epochs=1", "warm_start.batch_size=4", "rollout.tasks_per_step=2",
            "rollout.group_size=2", "rollout.max_new_tokens=16", "env.max_turns=2")
"""Overrides (after TINY_RUN) that make a training run on the tiny model take seconds: a warm
start of one epoch over 4 demos, RL steps of 2 tasks x 2 samples, episodes of at most 2 turns
of 16 new tokens. Steps, evaluation, minibatches and engine are left to each test."""


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """SMALL saved once per session as a model directory. Every test that asks for it gets the
    same directory: read it, train from it, never write into it."""
    return save_tiny_default(tmp_path_factory.mktemp("tiny-model"), SMALL)


def float64_model(vocab: int, seed: int = 0):
    """A FLOAT64-sized Qwen2 over `vocab` tokens (pad 0, end 1) with weights from `seed`, in float64."""
    return build_tiny_model(replace(FLOAT64, seed=seed), vocab, pad_token_id=0, eos_token_id=1).double()


def limits(max_turns: int = 8, max_context_tokens: int = 3072, max_new_tokens: int = 160, env_threads: int = 4,
           interruptible: bool = True, label_steps: bool = False, lockstep: bool = False) -> EpisodeLimits:
    """Episode limits for tests that run the scheduler, engines or agent loop directly: every value
    explicit (the library's EpisodeLimits has no defaults; a run's come from its config)."""
    return EpisodeLimits(max_turns=max_turns, max_context_tokens=max_context_tokens, max_new_tokens=max_new_tokens,
                         env_threads=env_threads, interruptible=interruptible, label_steps=label_steps,
                         lockstep=lockstep)


@pytest.fixture(scope="module")
def policy():
    """The byte tokenizer and a float64 tiny Qwen2 (2 layers, 4 heads over 2 kv heads) for
    sampling tests that compare paths at float64 rounding."""
    tokenizer = build_tiny_tokenizer()
    spec = TinyModelSpec(layers=2, hidden=32, heads=4, kv_heads=2, intermediate=48, max_positions=512, seed=3)
    model = build_tiny_model(spec, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id).double().eval()
    return model, tokenizer


def action_runs(trajectory) -> list[list[int]]:
    """A trajectory's action tokens, one list per turn, in order."""
    runs: dict[int, list[int]] = {}
    for token, acting, turn in zip(trajectory.token_ids, trajectory.action_mask, trajectory.turn_ids):
        if acting:
            runs.setdefault(turn, []).append(token)
    return [runs[turn] for turn in sorted(runs)]


REPO = Path(__file__).resolve().parents[1]


def keel_cli(*args: str) -> subprocess.CompletedProcess:
    """`keel ARGS` through `keelrl.cli.main`, the console script's own function, in this test's
    process and from the checkout's root (REPO): what `subprocess.run([keel, *args], cwd=REPO,
    capture_output=True, text=True)` returns (the exit status, stdout, stderr), without a new
    interpreter importing torch and transformers again, seconds a call. An exception a command lets out fails the test with its traceback.
    What a command may change for the whole process is put back: the working directory, the
    environment, the SIGTERM handler and torch's thread count. Tests of the console script
    itself, of a process killed or served, start `keel` as a process."""
    from keelrl.cli import main

    out, err = io.StringIO(), io.StringIO()
    before = os.getcwd(), dict(os.environ), signal.getsignal(signal.SIGTERM), torch.get_num_threads()
    try:
        os.chdir(REPO)
        with redirect_stdout(out), redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as done:  # argparse's errors (2) and --version (0), as the script exits
                code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
                if isinstance(done.code, str):
                    print(done.code, file=sys.stderr)
    finally:
        os.chdir(before[0])
        os.environ.clear()
        os.environ.update(before[1])
        signal.signal(signal.SIGTERM, before[2])
        torch.set_num_threads(before[3])
    return subprocess.CompletedProcess(["keel", *args], code, out.getvalue(), err.getvalue())


def step_one_rollouts(trainer):
    """Step 1's rollouts of `trainer` after its warm start, from an engine started and closed here."""
    trainer.warm_start()
    engine = trainer.make_engine()
    engine.start(0)
    try:
        return engine.batch(1)
    finally:
        engine.close()
