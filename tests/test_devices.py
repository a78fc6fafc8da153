"""The algorithm core runs on every available device and agrees with float64 on the CPU."""

import pytest
import torch

from keelrl.algos import PRESETS, AlgoConfig, compute_advantages, outcome_to_token_rewards, policy_objective
from keelrl.algos.losses import entropy_from_logits, value_loss

from conftest import available_devices


@pytest.mark.parametrize("device", available_devices())
@pytest.mark.parametrize("preset", list(PRESETS))
def test_full_step_on_device_matches_float64_cpu(device, preset):
    generator = torch.Generator().manual_seed(hash(preset) % 1000)
    batch, length, vocab = 6, 12, 11
    mask = torch.rand(batch, length, generator=generator) < 0.7
    mask[:, -1] = True
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 0.25])
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1])
    turn_ids = torch.arange(length).expand(batch, length) // 4
    values = torch.rand(batch, length, generator=generator)
    logits = torch.randn(batch, length, vocab, generator=generator)
    tokens = torch.randint(vocab, (batch, length), generator=generator)
    old_logp = torch.log_softmax(logits + 0.1 * torch.randn(logits.shape, generator=generator), -1)
    old_logp = old_logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    ref_logp = old_logp - 0.05
    prox_logp = old_logp + 0.3 * torch.randn(old_logp.shape, generator=generator)  # used by 'decoupled'

    def step(dev: str, dtype: torch.dtype):
        cfg = AlgoConfig(preset=preset, entropy_coef=0.01)
        to = lambda x: x.to(dev, dtype) if x.is_floating_point() else x.to(dev)  # noqa: E731
        leaf = to(logits).detach().clone().requires_grad_(True)
        logp = torch.log_softmax(leaf, -1).gather(-1, to(tokens).unsqueeze(-1)).squeeze(-1)
        adv = compute_advantages(token_rewards=outcome_to_token_rewards(to(rewards), to(mask)), mask=to(mask),
                                 group_ids=to(group_ids), values=to(values), turn_ids=to(turn_ids), cfg=cfg)
        loss, metrics = policy_objective(logp=logp, old_logp=to(old_logp), advantages=adv.advantages,
                                         mask=to(mask), cfg=cfg, ref_logp=to(ref_logp),
                                         entropy=entropy_from_logits(leaf).to(dtype), prox_logp=to(prox_logp))
        vloss, _ = value_loss(to(values) + 0.1, to(values), adv.returns, to(mask), cfg)
        (loss + vloss).backward()
        return loss, leaf.grad, metrics

    loss, grad, metrics = step(device, torch.float32)
    ref_loss, ref_grad, ref_metrics = step("cpu", torch.float64)
    assert loss.device.type == torch.device(device).type
    assert all(value.device.type == torch.device(device).type for value in metrics.values())
    torch.testing.assert_close(loss.double().cpu(), ref_loss, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grad.double().cpu(), ref_grad, rtol=1e-3, atol=1e-5)
    for key in ref_metrics:
        torch.testing.assert_close(metrics[key].double().cpu(), ref_metrics[key], rtol=1e-3, atol=1e-5)


def test_pin_to_cores_moves_every_thread_of_the_process_and_sets_torch_threads():
    """In a child process (pinning is process-wide): threads that existed before are moved too."""
    import subprocess
    import sys

    code = """
import os, threading, time, torch
from keelrl.policy.model import pin_to_cores
torch.ones(256, 256) @ torch.ones(256, 256)  # torch's pool exists before the pin
event = threading.Event()
waiter = threading.Thread(target=event.wait); waiter.start()
pin_to_cores([0])
cores = {tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir('/proc/self/task')}
event.set(); waiter.join()
print(sorted(cores), torch.get_num_threads())
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[(0,)] 1"


def test_cores_that_the_machine_lacks_or_repeats_fail_at_config_time_naming_the_field():
    import os

    from keelrl.config import load_config
    from keelrl.errors import ConfigError

    count = os.cpu_count() or 1
    with pytest.raises(ConfigError, match=rf"perf.learner_cores.*no such CPU core {count}"):
        load_config(overrides=[f"perf.learner_cores=[{count}]"])
    with pytest.raises(ConfigError, match=r"rollout.worker_cores.*listed twice"):
        load_config(overrides=["rollout.worker_cores=[0, 0]"])
    assert load_config(overrides=["rollout.worker_cores=[0]"]).rollout.worker_cores == [0]
