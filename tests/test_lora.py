"""LoRA through peft (`model.lora`, keelrl.policy.lora): the config, which weights train, the KL
reference without a second model, the merged weights decoders read, adapter-only checkpoints
and resumes, and a `keel train` + `keel eval` of a LoRA run on the tiny model."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from conftest import FAST_RUN, float64_model, keel_cli
from safetensors.torch import load_file

from keelrl.config import LORA_TARGETS, TINY_RUN, LoraSettings, load_config
from keelrl.errors import ConfigError
from keelrl.policy import lora
from keelrl.policy.model import load_policy
from keelrl.policy.prefix import chunked_token_logprobs
from keelrl.runs import latest_checkpoint
from keelrl.train.trainer import Trainer

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "optim.lr=2e-3", "algo.entropy_coef=0.05"]
"""A LoRA run of the tiny model: rank 4 on every projection, a learning rate that moves it in a few
steps, and an entropy bonus, which moves it whatever the rewards (the tiny model often earns none)."""


def run_overrides(model_dir: Path, run_dir: Path, *more: str) -> list[str]:
    return [*TINY_RUN, *FAST_RUN, f"model.path={model_dir}", f"run_dir={run_dir}", "rollout.engine=sync",
            "eval.tasks=2", "eval.every=100", "output.sample_trajectories=0", *LORA, *more]


def base_parameters(model) -> dict[str, torch.Tensor]:
    """The base model's weights of a LoRA model, under the base names, as they are now (copies)."""
    with lora.adapter_off(model):
        return {name: tensor.detach().clone() for name, tensor in lora.merged_state_dict(model).items()}


# ----------------------------------------------------------------- config


@pytest.mark.parametrize("override, field, says", [
    ("model.lora.rank=-1", "model.lora.rank", ">= 0"),
    ("model.lora.rank=2.5", "model.lora.rank", "expected int"),
    ("model.lora.alpha=0", "model.lora.alpha", "> 0"),
    ("model.lora.alpha=-4", "model.lora.alpha", "> 0"),
    ("model.lora.dropout=1.0", "model.lora.dropout", "[0, 1)"),
    ("model.lora.dropout=-0.1", "model.lora.dropout", "[0, 1)"),
    ("model.lora.target_modules=[q_proj,q_proj]", "model.lora.target_modules", "more than once"),
    ("model.lora.target_modules=[' q_proj']", "model.lora.target_modules", "not a module name"),
    ("model.lora.rnak=4", "model.lora.rnak", "did you mean 'model.lora.rank'"),
])
def test_bad_lora_settings_fail_at_config_time_naming_the_field(override, field, says):
    with pytest.raises(ConfigError) as caught:
        load_config(overrides=[override])
    assert caught.value.field == field and says in str(caught.value)


def test_lora_is_off_by_default_and_its_keys_load():
    assert load_config().model.lora == LoraSettings(rank=0, alpha=16.0, target_modules=list(LORA_TARGETS), dropout=0.0)
    settings = load_config(overrides=["model.lora.rank=8", "model.lora.alpha=4", "model.lora.dropout=0.05",
                                      "model.lora.target_modules=[q_proj,v_proj]"]).model.lora
    assert (settings.rank, settings.alpha, settings.dropout, settings.target_modules) == (8, 4.0, 0.05, ["q_proj", "v_proj"])
    with pytest.raises(ConfigError, match="needs at least one target module"):
        load_config(overrides=["model.lora.rank=8", "model.lora.target_modules=[]"])


def test_a_target_the_model_lacks_fails_when_the_model_is_built_listing_its_linear_layers():
    model = float64_model(vocab=40)
    with pytest.raises(ConfigError) as caught:
        lora.apply_lora(model, LoraSettings(rank=2, target_modules=["q_proj", "qkv_proj"]), base="tiny")
    message = str(caught.value)
    assert caught.value.field == "model.lora.target_modules" and "'qkv_proj'" in message
    assert "q_proj" in message and "down_proj" in message and "lm_head" in message
    assert not lora.is_lora(model)  # nothing was injected


# ----------------------------------------------------------------- merged weights


def _lora_float64(seed: int = 0):
    """A float64 tiny model with a rank-3 adapter whose A and B are random (B is zero at peft's start)."""
    model = lora.apply_lora(float64_model(vocab=40, seed=seed), LoraSettings(rank=3, alpha=5.0), base="tiny")
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for parameter in lora.adapter_parameters(model).values():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * 0.3)
    return model.eval()


def test_merged_weights_give_the_peft_models_forward_in_float64():
    model = _lora_float64()
    plain = float64_model(vocab=40).eval()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    merged = lora.merged_state_dict(model)
    assert set(merged) == set(plain.state_dict())  # the base's names: no base_model.model., base_layer or lora_
    plain.load_state_dict(merged)
    ids = torch.randint(2, 40, (3, 17), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = lora.peft_model(model)(input_ids=ids).logits  # peft's own forward, adapter on
        got = plain(input_ids=ids).logits
        base = float64_model(vocab=40).eval()(input_ids=ids).logits
    assert torch.allclose(got, want, rtol=0, atol=1e-10)
    assert (want - base).abs().max() > 1e-3  # the adapter does change the outputs
    # computed without touching the model: nothing merged, every tensor as it was
    assert not any(layer.merged for layer in lora.lora_layers(model).values())
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    # the wrapper gives the same dict; a plain model gives its own state dict
    wrapped = lora.merged_state_dict(lora.peft_model(model))
    assert all(torch.equal(wrapped[name], merged[name]) for name in merged)
    untouched = float64_model(vocab=40)
    own = untouched.state_dict()
    assert all(tensor is own[name] or torch.equal(tensor, own[name])
               for name, tensor in lora.merged_state_dict(untouched).items()) and not lora.is_lora(untouched)


def test_with_the_adapter_off_the_merged_weights_are_the_base():
    model = _lora_float64()
    base = float64_model(vocab=40).state_dict()
    with lora.adapter_off(model):
        merged = lora.merged_state_dict(model)
    assert all(torch.equal(merged[name], base[name]) for name in base)
    assert any(not torch.equal(lora.merged_state_dict(model)[name], base[name]) for name in base)


def test_the_adapter_state_dict_holds_the_adapters_alone_and_a_merged_copy_is_plain():
    model = _lora_float64()
    adapter = lora.adapter_state_dict(model)
    layers = model.config.num_hidden_layers
    assert len(adapter) == 2 * len(LORA_TARGETS) * layers and all("lora_" in name for name in adapter)
    plain = lora.merged_copy(model)
    assert not lora.is_lora(plain) and lora.is_lora(model)  # the original keeps its adapter
    ids = torch.randint(2, 40, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(plain(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=1e-10)
    assert set(plain.state_dict()) == set(lora.merged_state_dict(model))  # published merged dicts load into it


# ----------------------------------------------------------------- what trains


def test_only_the_adapters_and_the_critic_train_and_the_base_never_moves(tiny_model_dir, tmp_path):
    trainer = Trainer(load_config(overrides=run_overrides(tiny_model_dir, tmp_path, "algo.preset=ppo",
                                                          "train.steps=2")))
    adapters = lora.adapter_parameters(trainer.model)
    assert adapters and all(parameter.requires_grad for parameter in adapters.values())
    assert {name for name, p in trainer.model.named_parameters() if p.requires_grad} == set(adapters)
    optimised = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert optimised == {id(p) for p in adapters.values()} | {id(p) for p in trainer.value_head.parameters()}
    base_before = base_parameters(trainer.model)
    fresh, _ = load_policy(str(tiny_model_dir), "cpu")
    assert all(torch.equal(base_before[name], tensor) for name, tensor in fresh.state_dict().items())
    adapter_before = {name: p.detach().clone() for name, p in adapters.items()}
    trainer.run()
    assert all(torch.equal(base_before[name], tensor) for name, tensor in base_parameters(trainer.model).items())
    assert any(not torch.equal(adapter_before[name], p.detach()) for name, p in adapters.items())
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["train/updates"] >= 1 and "value/loss" in rows[-1]


# ----------------------------------------------------------------- the reference


class _Recorder:
    """Stands in for the trainer's advantage stage and keeps each step's batch and result."""

    def __init__(self, stage) -> None:
        self.stage, self.calls = stage, []

    def __getattr__(self, name):
        return getattr(self.stage, name)

    def __call__(self, batch, *args, **kwargs):
        out = self.stage(batch, *args, **kwargs)
        self.calls.append((batch, out))
        return out


def _logp(model, batch, temperature):
    with torch.no_grad():
        return chunked_token_logprobs(model, batch.input_ids, batch.attention_mask, max_tokens=4096,
                                      positions=batch.action_mask, temperature=temperature)["logp"]


def test_the_reference_is_the_base_with_the_adapter_off_and_no_second_model(tiny_model_dir, tmp_path, monkeypatch):
    copied, loads = [], []
    real_deepcopy, real_load = copy.deepcopy, load_policy

    def spy_deepcopy(value, *args, **kwargs):
        if isinstance(value, torch.nn.Module):
            copied.append(type(value).__name__)
        return real_deepcopy(value, *args, **kwargs)

    def spy_load(*args, **kwargs):
        loads.append(args)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(copy, "deepcopy", spy_deepcopy)
    monkeypatch.setattr("keelrl.train.trainer.load_policy", spy_load)
    # no warm start: the adapter is zero as RL starts, so the reference is the base itself
    cfg = load_config(overrides=run_overrides(tiny_model_dir, tmp_path, "warm_start.demos=0", "train.steps=3"))
    assert cfg.algo.kl_coef > 0
    trainer = Trainer(cfg)
    assert isinstance(trainer.reference, lora.AdapterReference) and trainer.reference.model is trainer.model
    recorder = _Recorder(trainer.advantages)
    trainer.advantages = recorder
    trainer.run()
    assert len(loads) == 1 and copied == []  # one model loaded, none copied
    assert trainer.reference.adapter is None and not lora.adapter_is_zero(trainer.model)
    assert sorted(p.name for p in (tmp_path / "reference").iterdir()) == sorted(
        ["README.md", lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS])  # an adapter, not a model
    fresh, _ = real_load(str(tiny_model_dir), "cpu")
    temperature = cfg.rollout.temperature
    for batch, out in recorder.calls:
        expected = _logp(fresh.eval(), batch, temperature)
        assert torch.allclose(out.inputs.ref_logp, expected, rtol=0, atol=1e-5)
    batch = recorder.calls[-1][0]
    mask = batch.action_mask
    policy = _logp(trainer.model.eval(), batch, temperature)
    with trainer.reference.active():
        reference = _logp(trainer.model, batch, temperature)
    assert torch.allclose(reference, _logp(fresh, batch, temperature), rtol=0, atol=1e-5)
    assert (policy - reference)[mask].abs().max() > 1e-3  # RL moved the policy away from its reference
    assert not lora.adapter_is_zero(trainer.model)  # the context switched the adapter back on
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["policy/kl_ref"] > 0


def test_after_a_warm_start_the_reference_keeps_the_adapter_as_rl_started(tiny_model_dir, tmp_path):
    cfg = load_config(overrides=run_overrides(tiny_model_dir, tmp_path, "train.steps=2"))
    trainer = Trainer(cfg)
    recorder = _Recorder(trainer.advantages)
    trainer.advantages = recorder
    trainer.run()
    assert trainer.reference.adapter is not None  # the warm start trained the adapter
    live = lora.adapter_parameters(trainer.model)
    assert any(not torch.equal(trainer.reference.adapter[name], p.detach()) for name, p in live.items())
    # the reference is base + the adapter reference/ holds, which loads as a model.path of its own
    as_started, _ = load_policy(str(tmp_path / "reference"), "cpu")
    for batch, out in recorder.calls:
        assert torch.allclose(out.inputs.ref_logp, _logp(as_started.eval(), batch, cfg.rollout.temperature),
                              rtol=0, atol=1e-5)
    before = {name: p.detach().clone() for name, p in live.items()}
    with trainer.reference.active():
        pass
    assert all(torch.equal(before[name], p.detach()) for name, p in live.items())  # the policy's adapter is back


# ----------------------------------------------------------------- checkpoints and resume


def _folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def test_checkpoints_hold_the_adapter_alone_and_a_resume_continues_it(tiny_model_dir, tmp_path):
    overrides = ["train.steps=4", "output.checkpoint_every=2"]
    full = Trainer(load_config(overrides=run_overrides(tiny_model_dir, tmp_path / "full", *overrides)))
    full.run()
    part_dir = tmp_path / "part"
    Trainer(load_config(overrides=run_overrides(tiny_model_dir, part_dir, *overrides))).run(stop_after=2)
    checkpoint = latest_checkpoint(part_dir)
    saved = checkpoint / "model"
    assert lora.is_adapter_dir(saved) and not (saved / "config.json").exists()
    assert not list(saved.glob("model*.safetensors"))  # no base weights
    names = list(load_file(str(saved / lora.ADAPTER_WEIGHTS)))
    assert names and all("lora_" in name for name in names)
    base_bytes = (tiny_model_dir / "model.safetensors").stat().st_size
    assert (saved / lora.ADAPTER_WEIGHTS).stat().st_size < base_bytes / 5
    assert _folder_bytes(checkpoint) < base_bytes  # adapter, optimiser, tokenizer and state: less than the base
    assert json.loads((saved / lora.ADAPTER_CONFIG).read_text())["base_model_name_or_path"] == \
        str(tiny_model_dir.resolve())

    resumed = Trainer(load_config(part_dir / "config.yaml"))
    resumed.run(resume=True)
    want = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    got = [json.loads(line) for line in (part_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in got] == [0, 1, 2, 3, 4]
    for expected, row in zip(want[3:], got[3:]):
        for key, value in expected.items():
            if key.startswith(("time/", "engine/", "memory/")) or not isinstance(value, (int, float)):
                continue
            assert row[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    final = lora.adapter_parameters(full.model)
    assert all(torch.allclose(p, final[name], rtol=1e-5, atol=1e-6)
               for name, p in lora.adapter_parameters(resumed.model).items())
    assert all(torch.equal(resumed.reference.adapter[name], full.reference.adapter[name])
               for name in full.reference.adapter)  # reference/ restored the reference's adapter

    # the checkpoint's model/ loads as base + adapter: the trained policy
    loaded, _ = load_policy(str(latest_checkpoint(part_dir) / "model"), "cpu")
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(loaded.eval()(input_ids=ids).logits, resumed.model.eval()(input_ids=ids).logits,
                              rtol=0, atol=1e-6)


def test_a_resume_with_another_lora_setting_is_refused(tiny_model_dir, tmp_path):
    from keelrl.runs import CheckpointError

    Trainer(load_config(overrides=run_overrides(tiny_model_dir, tmp_path, "train.steps=0"))).run()
    with pytest.raises(CheckpointError, match="holds a LoRA adapter.*model.lora.rank is 0"):
        Trainer(load_config(tmp_path / "config.yaml", ["model.lora.rank=0"])).run(resume=True)
    with pytest.raises(CheckpointError, match="does not fit|another model.lora"):
        Trainer(load_config(tmp_path / "config.yaml", ["model.lora.rank=2"])).run(resume=True)


def test_a_separate_critic_of_a_lora_policy_trains_its_own_adapter_and_is_checkpointed_small(tiny_model_dir, tmp_path):
    cfg = load_config(overrides=run_overrides(tiny_model_dir, tmp_path, "algo.preset=ppo", "model.critic=separate",
                                              "train.steps=0"))
    trainer = Trainer(cfg)
    body = trainer.value_head.body
    assert lora.is_lora(body)
    trainable = {name for name, p in trainer.value_head.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name or name.startswith("head.") for name in trainable)
    with torch.no_grad():
        for name, parameter in trainer.value_head.named_parameters():
            if parameter.requires_grad:
                parameter.add_(0.01)
    trainer.save_checkpoint()
    state = torch.load(latest_checkpoint(tmp_path) / "state.pt", weights_only=False)
    assert set(state["value_head"]) == trainable  # the critic's frozen base is not in the checkpoint
    again = Trainer(cfg)
    again.load_checkpoint()
    mine = dict(trainer.value_head.named_parameters())
    assert all(torch.equal(p, mine[name]) for name, p in again.value_head.named_parameters())


# ----------------------------------------------------------------- the command line


def test_keel_train_with_lora_then_keel_eval_on_its_checkpoint(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    overrides = [*TINY_RUN, *FAST_RUN, f"model.path={tiny_model_dir}", f"run_dir={run_dir}", "train.steps=2",
                 "eval.tasks=2", "eval.every=2", "model.lora.rank=4", "optim.lr=2e-3"]  # TINY_RUN's async engine
    result = keel_cli("train", *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2] and "eval/success" in rows[-1]
    assert lora.is_adapter_dir(latest_checkpoint(run_dir) / "model")
    result = keel_cli("eval", str(run_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout[result.stdout.index("{"):])
    assert 0 <= report["eval/success"] <= 1


def test_a_rollout_sides_own_copy_of_a_lora_policy_is_plain_and_takes_the_published_weights():
    """The async engine's and the endpoint's copy of the policy (keelrl.inference.own_copy) is a
    plain model with the adapter merged in, into which the published merged state dicts load."""
    from keelrl.inference import own_copy, published_state

    model = _lora_float64()
    own = own_copy(model)
    assert not lora.is_lora(own) and lora.is_lora(model)
    with torch.no_grad():
        for parameter in lora.adapter_parameters(model).values():
            parameter.mul_(-1.0)  # new policy weights
    own.load_state_dict(published_state(model))
    ids = torch.randint(2, 40, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.allclose(own(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=1e-10)
