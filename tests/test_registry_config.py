"""Registries, presets and configuration: names fail early and list the valid choices."""

import dataclasses
from pathlib import Path

import pytest
import yaml

import keelrl.algos as algos
from keelrl.algos import ALL, PRESETS, AlgoConfig, UnknownNameError
from keelrl.algos.catalogue import choices_for, comparison_table
from keelrl.algos.presets import BASE_SETTINGS, Preset, _build
from keelrl.registry import Registry
from keelrl.components import explain
from keelrl.config import KeelConfig, apply_overrides, dump_config, field_docs, from_dict, load_config
from keelrl.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def test_every_kind_has_the_components_the_design_names():
    assert set(ALL["advantage"].names()) >= {"reinforce", "grpo", "dr_grpo", "rloo", "reward_to_go", "td", "gae"}
    assert set(ALL["ratio"].names()) >= {"token", "sequence", "sequence_token", "cumulative", "ctpo"}
    assert set(ALL["clip"].names()) >= {"ppo", "dual_clip", "cispo", "tis", "none"}
    assert set(ALL["aggregation"].names()) >= {"token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant"}
    assert ALL["kl_estimator"].names() == ["k1", "k2", "k3"]
    assert set(PRESETS) == {"reinforce", "ppo", "grpo", "dr_grpo", "turn_rloo", "rloo", "dapo", "cispo", "gspo", "ctpo", "decoupled"}


def test_duplicate_registration_fails():
    registry: Registry = Registry("thing")
    registry.register("a", summary="first")(lambda: 1)
    with pytest.raises(ValueError, match="duplicate thing name 'a'"):
        registry.register("a", summary="second")(lambda: 2)


def test_duplicate_name_in_a_real_registry_fails_and_leaves_it_intact():
    before = algos.RATIOS.get("token")
    with pytest.raises(ValueError, match="duplicate"):
        algos.RATIOS.register("token", summary="impostor")(lambda *a: None)
    assert algos.RATIOS.get("token") is before


def test_unknown_lookup_lists_valid_names_from_the_registry():
    with pytest.raises(UnknownNameError) as info:
        algos.POLICY_LOSSES.get("ppo2")
    message = str(info.value)
    assert "'ppo2'" in message
    for name in algos.POLICY_LOSSES.names():
        assert name in message


@pytest.mark.parametrize("field", ["advantage", "ratio", "clip", "aggregation", "kl_estimator"])
def test_unknown_component_name_fails_at_config_time_naming_field_and_choices(field):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[f"algo.{field}=nope"])
    assert info.value.field == f"algo.{field}"
    for name in ALL[field].names():
        assert name in str(info.value)


def test_unknown_preset_lists_presets():
    with pytest.raises(ConfigError) as info:
        AlgoConfig(preset="ppo2")
    assert info.value.field == "preset"
    assert all(name in str(info.value) for name in PRESETS)


@pytest.mark.parametrize("override, field", [
    ("algo.eps_low=1.5", "algo.eps_low"),
    ("algo.eps_high=-0.1", "algo.eps_high"),
    ("algo.gamma=1.01", "algo.gamma"),
    ("algo.lam=-1", "algo.lam"),
    ("algo.dual_clip_c=1.0", "algo.dual_clip_c"),
    ("algo.tis_cap=0", "algo.tis_cap"),
    ("algo.kl_coef=-0.1", "algo.kl_coef"),
    ("algo.level=episode", "algo.level"),
    ("algo.agg_constant=0", "algo.agg_constant"),
    ("algo.eps_low=.nan", "algo.eps_low"),
    ("algo.eps_low=abc", "algo.eps_low"),
    ("algo.whiten=3", "algo.whiten"),
    ("seed=1.5", "seed"),
    ("device=gpu", "device"),
    ("algo.nope=1", "algo.nope"),
    ("nope.x=1", "nope"),
])
def test_bad_values_name_the_dotted_field(override, field):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    assert info.value.field == field
    assert str(info.value).startswith(field + ":")


def test_malformed_override_is_rejected():
    with pytest.raises(ConfigError, match="dotted.key=value"):
        apply_overrides({}, ["algo.preset"])
    with pytest.raises(ConfigError, match="is a value, not a section"):
        apply_overrides({"seed": 1}, ["seed.x=2"])


def test_preset_fills_unset_fields_and_user_fields_win():
    cfg = AlgoConfig(preset="dapo")
    assert (cfg.eps_low, cfg.eps_high, cfg.aggregation, cfg.dynamic_sampling) == (0.2, 0.28, "token_mean", True)
    cfg = AlgoConfig(preset="dapo", eps_high=0.35, dynamic_sampling=False)
    assert (cfg.eps_high, cfg.dynamic_sampling, cfg.eps_low) == (0.35, False, 0.2)
    # Every field is concrete after resolution (agg_constant may legitimately stay None).
    for f in dataclasses.fields(cfg):
        assert getattr(cfg, f.name) is not None or f.name in {"agg_constant"}


def test_presets_name_their_defining_settings():
    assert AlgoConfig(preset="ppo").uses_critic and AlgoConfig(preset="ppo").advantage == "gae"
    assert not AlgoConfig(preset="grpo").uses_critic
    assert AlgoConfig(preset="grpo").kl_coef > 0 and AlgoConfig(preset="grpo").kl_estimator == "k3"
    assert AlgoConfig(preset="dr_grpo").aggregation == "constant"
    assert AlgoConfig(preset="dr_grpo").advantage == "dr_grpo"
    assert AlgoConfig(preset="rloo").advantage == "rloo"
    assert AlgoConfig(preset="cispo").clip == "cispo"
    assert AlgoConfig(preset="gspo").ratio == "sequence"
    assert AlgoConfig(preset="ctpo").ratio == "ctpo"
    assert AlgoConfig(preset="dapo").eps_high > AlgoConfig(preset="dapo").eps_low


def test_preset_table_rows_come_from_the_registries():
    rows = {row["preset"]: row for row in comparison_table()}
    assert set(rows) == set(PRESETS)
    for name, row in rows.items():
        cfg = AlgoConfig(preset=name)
        assert row["components"] == {"advantage": cfg.advantage, "ratio": cfg.ratio, "clip": cfg.clip,
                                     "aggregation": cfg.aggregation}
        assert row["credit"].startswith(ALL["advantage"].entry(cfg.advantage).summary)
        assert row["token_weighting"].startswith(ALL["ratio"].entry(cfg.ratio).summary)
    assert "1.28" in rows["dapo"]["update_limit"] and "0.8" in rows["dapo"]["update_limit"]
    assert rows["dapo"]["dynamic_sampling"] and not rows["grpo"]["dynamic_sampling"]
    assert rows["ppo"]["critic"] and "reward" in rows["ppo"]["kl"]


def test_bad_presets_fail_when_built():
    with pytest.raises(ValueError, match="duplicate preset"):
        _build([Preset("a", "x"), Preset("a", "y")])
    with pytest.raises(ValueError, match="unknown fields"):
        _build([Preset("a", "x", {"epsilon": 0.2})])
    assert set(BASE_SETTINGS) == {f.name for f in dataclasses.fields(AlgoConfig)} - {"preset"}


def test_yaml_round_trip_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("seed: 7\nalgo:\n  preset: gspo\n  entropy_coef: 0.01\n")
    cfg = load_config(path, ["algo.eps_high=0.001", "device=cpu"])
    assert (cfg.seed, cfg.device, cfg.algo.preset, cfg.algo.ratio) == (7, "cpu", "gspo", "sequence")
    assert cfg.algo.entropy_coef == 0.01 and cfg.algo.eps_high == 0.001
    again = from_dict(KeelConfig, yaml.safe_load(dump_config(cfg)))
    assert again == cfg


def test_bad_files_fail_clearly(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(tmp_path / "list.yaml")
    (tmp_path / "broken.yaml").write_text("algo: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "broken.yaml")
    (tmp_path / "nested.yaml").write_text("algo: 3\n")
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "nested.yaml")
    assert info.value.field == "algo"


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = load_config(path)
    if path.stem in PRESETS:
        assert cfg.algo.preset == path.stem


def test_every_preset_has_a_config_file():
    assert {p.stem for p in (REPO / "configs").glob("*.yaml")} >= set(PRESETS) | {"default"}


def test_every_field_has_help_and_component_fields_list_choices():
    docs = field_docs(AlgoConfig)
    assert set(docs) == {f.name for f in dataclasses.fields(AlgoConfig)}
    assert all(text.strip() for text in docs.values())
    rows = {path: help_text for path, _, help_text in explain()}
    assert set(rows) >= {"seed", "device", "algo.preset", "algo.clip"}
    for field in ("advantage", "ratio", "clip", "aggregation", "kl_estimator"):
        assert choices_for(field) == ALL[field].names()
        assert all(name in rows[f"algo.{field}"] for name in ALL[field].names())
    assert choices_for("preset") == list(PRESETS)
    assert choices_for("gamma") == []


def test_registering_a_function_with_the_wrong_signature_fails():
    with pytest.raises(TypeError, match=r"must take \(logp, old_logp, mask, cfg\)"):
        algos.RATIOS.register("wrong_signature", summary="x")(lambda logp, mask, cfg: logp)
    assert "wrong_signature" not in algos.RATIOS


@pytest.mark.parametrize("kwargs, field", [
    ({"max_log_ratio": 200.0}, "max_log_ratio"),   # exp(200) is inf in float32
    ({"eps_high": float("inf")}, "eps_high"),
    ({"kl_coef": float("inf")}, "kl_coef"),
    ({"dual_clip_c": float("inf")}, "dual_clip_c"),
    ({"tis_cap": float("inf")}, "tis_cap"),
    ({"agg_constant": True}, "agg_constant"),
    ({"agg_constant": 2.5}, "agg_constant"),
    ({"agg_constant": "8"}, "agg_constant"),
    ({"tis_cap": "2"}, "tis_cap"),
    ({"whiten": 1}, "whiten"),
    ({"aggregation": "constant", "agg_constant": None}, "agg_constant"),
])
def test_direct_construction_rejects_bad_values_with_config_errors(kwargs, field):
    with pytest.raises(ConfigError) as info:
        AlgoConfig(preset="grpo", **kwargs)
    assert info.value.field == field


def test_yaml_1_1_exponent_floats_are_accepted(tmp_path):
    # PyYAML reads 4e-4 (no dot) as a string; GSPO's own value must still work.
    cfg = load_config(overrides=["algo.preset=gspo", "algo.eps_high=4e-4", "algo.eps_low=3e-4"])
    assert (cfg.algo.eps_low, cfg.algo.eps_high) == (3e-4, 4e-4)
    (tmp_path / "c.yaml").write_text("algo:\n  entropy_coef: 1e-3\n")
    assert load_config(tmp_path / "c.yaml").algo.entropy_coef == 1e-3
    with pytest.raises(ConfigError):
        load_config(overrides=["algo.eps_high=4e-4x"])


def test_default_and_tiny_yaml_spell_out_the_default_run_and_the_tiny_recipe():
    from keelrl.config import TINY_RUN, to_dict

    assert to_dict(load_config(REPO / "configs" / "default.yaml")) == to_dict(load_config())
    assert to_dict(load_config(REPO / "configs" / "tiny.yaml")) == to_dict(load_config(overrides=list(TINY_RUN)))
    assert load_config().model.path == "smollm2"


def test_a_field_moved_out_of_the_train_section_says_where_it_went():
    for old, new in (("train.lr", "optim.lr"), ("train.eval_every", "eval.every"),
                     ("train.save_episodes", "output.save_episodes"), ("train.micro_batch_tokens", "perf.micro_batch_tokens")):
        with pytest.raises(ConfigError) as info:
            load_config(overrides=[f"{old}=1"])
        assert info.value.field == old and f"is now {new}" in str(info.value)
        assert load_config(overrides=[f"{new}=3"]) is not None
    cfg = load_config(overrides=["optim.lr=0.5", "eval.every=2", "perf.share_prefix=false", "train.epochs=2"])
    assert (cfg.optim.lr, cfg.eval.every, cfg.perf.share_prefix, cfg.train.epochs) == (0.5, 2, False, 2)
