"""The one registry mechanism (keelrl/registry.py): registration checks, the error for an unknown
name, the mapping view, and every named-component registry built on it."""

from __future__ import annotations

import ast
import importlib
from dataclasses import dataclass
from pathlib import Path

import pytest

from keelrl.errors import ConfigError
from keelrl.registry import Entry, Registry, UnknownNameError

REPO = Path(__file__).resolve().parents[1]


def two_arg(a, b):
    return a + b


def other_two_arg(a, b):
    return a - b


@dataclass(frozen=True)
class Spec:
    name: str


def filled() -> Registry:
    registry: Registry = Registry("widget", params=("a", "b"))
    registry.register("plus", summary="a + b", tags=("sum",))(two_arg)
    registry.register("minus", summary="a - b")(other_two_arg)
    return registry


# ------------------------------------------------------------------ registering
def test_register_returns_the_function_and_stores_summary_and_tags():
    registry: Registry = Registry("widget")
    assert registry.register("plus", summary="a + b", tags=("sum", "pure"))(two_arg) is two_arg
    entry = registry.entry("plus")
    assert entry == Entry(name="plus", obj=two_arg, summary="a + b", tags=frozenset({"sum", "pure"}))
    assert entry.fn is two_arg  # the old name of `obj` still reads it


def test_a_duplicate_name_raises_names_the_first_and_keeps_it():
    registry = filled()
    with pytest.raises(ValueError, match=r"duplicate widget name 'plus': already registered by "
                                         r"(tests\.)?test_registry\.two_arg"):
        registry.register("plus", summary="again")(other_two_arg)
    with pytest.raises(ValueError, match="duplicate widget name 'plus'"):
        registry.add("plus", other_two_arg)
    assert registry["plus"] is two_arg and registry.entry("plus").summary == "a + b"
    assert registry.names() == ["plus", "minus"]


def test_the_signature_check_rejects_other_parameters_and_registers_nothing():
    registry = filled()
    with pytest.raises(TypeError, match=r"widget 'swapped' takes \(b, a\); every widget must take \(a, b\)"):
        registry.register("swapped", summary="x")(lambda b, a: a)
    with pytest.raises(TypeError, match=r"takes \(a, b, c\)"):
        registry.register("three", summary="x")(lambda a, b, c: a)
    with pytest.raises(TypeError, match=r"takes \(a\)"):
        registry.add("one", lambda a: a)
    with pytest.raises(TypeError, match="'constant' is not callable"):
        registry.add("constant", 3)
    assert registry.names() == ["plus", "minus"]


def test_without_params_any_object_registers():
    registry: Registry = Registry("thing")
    registry.register("three_args", summary="x")(lambda a, b, c: a)
    assert registry.add("spec", Spec("s")) == Spec("s")
    assert registry.add("number", 3, summary="three", tags=("odd",)) == 3
    assert registry["spec"] == Spec("s") and registry.get("number") == 3
    assert registry.entry("number").tags == frozenset({"odd"}) and registry.entry("spec").summary == ""


def test_a_duplicate_object_name_raises_without_a_qualname():
    registry: Registry = Registry("environment")
    registry.add("say", Spec("say"))
    with pytest.raises(ValueError) as info:
        registry.add("say", Spec("other"))
    assert str(info.value) == "duplicate environment name 'say': already registered"
    assert registry["say"] == Spec("say")


@pytest.mark.parametrize("name", ["", None, 3])
def test_a_name_must_be_a_non_empty_str(name):
    with pytest.raises(ValueError, match="must be a non-empty str"):
        Registry("thing").add(name, 1)


# ------------------------------------------------------------------ unknown names
def test_an_unknown_name_names_the_kind_the_name_and_every_valid_name():
    registry = filled()
    for lookup in (registry.get, registry.entry, registry.__getitem__):
        with pytest.raises(UnknownNameError) as info:
            lookup("times")
        assert str(info.value) == "unknown widget 'times'; valid names: plus, minus"
        assert info.value.field == ""
    error = info.value
    assert isinstance(error, KeyError) and isinstance(error, ConfigError) and isinstance(error, ValueError)


def test_check_names_the_dotted_field():
    registry = filled()
    registry.check("plus", "algo.widget")  # registered: no error
    with pytest.raises(UnknownNameError) as info:
        registry.check("times", "widget")
    assert info.value.field == "widget"
    assert str(info.value) == "widget: unknown widget 'times'; valid names: plus, minus"
    assert str(info.value.with_prefix("algo")).startswith("algo.widget: unknown widget 'times'")


def test_an_empty_registry_says_so():
    with pytest.raises(UnknownNameError, match=r"unknown thing 'x'; valid names: \(none registered\)"):
        Registry("thing")["x"]


def test_an_unhashable_name_is_unknown_not_a_type_error():
    registry = filled()
    assert ["plus"] not in registry
    with pytest.raises(UnknownNameError, match=r"unknown widget \['plus'\]"):
        registry[["plus"]]  # type: ignore[index]


# ------------------------------------------------------------------ the mapping view
def test_the_registry_reads_like_a_mapping_of_names_in_registration_order():
    registry = filled()
    registry.add("zero", lambda a, b: 0)
    assert list(registry) == ["plus", "minus", "zero"] == registry.names()
    assert len(registry) == 3
    assert "minus" in registry and "times" not in registry and None not in registry
    assert {name: registry[name](5, 3) for name in registry} == {"plus": 8, "minus": 2, "zero": 0}
    assert [entry.name for entry in registry.entries()] == ["plus", "minus", "zero"]
    assert ", ".join(registry) == "plus, minus, zero"  # how error messages list the choices
    assert (*registry, "any") == ("plus", "minus", "zero", "any")


def test_names_and_entries_are_copies():
    registry = filled()
    registry.names().append("times")
    registry.entries().clear()
    assert registry.names() == ["plus", "minus"] and len(registry) == 2


def test_unregister_removes_the_name_and_it_can_be_registered_again():
    registry = filled()
    registry.unregister("plus")
    assert "plus" not in registry and registry.names() == ["minus"]
    with pytest.raises(UnknownNameError, match="unknown widget 'plus'; valid names: minus"):
        registry.unregister("plus")
    registry.register("plus", summary="back, last")(two_arg)
    assert registry.names() == ["minus", "plus"]


def test_a_loop_over_the_names_may_unregister():
    registry = filled()
    for name in registry:
        registry.unregister(name)
    assert len(registry) == 0


# ------------------------------------------------------------------ every kind uses it
KINDS = [
    ("keelrl.algos.registries", "ADVANTAGES"),
    ("keelrl.algos.registries", "RATIOS"),
    ("keelrl.algos.registries", "POLICY_LOSSES"),
    ("keelrl.algos.registries", "AGGREGATIONS"),
    ("keelrl.algos.registries", "KL_ESTIMATORS"),
    ("keelrl.envs.registry", "ENVIRONMENTS"),
    ("keelrl.sinks", "SINKS"),
    ("keelrl.envs.verifiers", "VERIFIERS"),
    ("keelrl.policy.download", "MODELS"),
    ("keelrl.policy.critic", "CRITICS"),
    ("keelrl.alarms", "ALARMS"),
    ("keelrl.audit.rewrites", "REWRITES"),
    ("keelrl.audit.probes", "FALSE_POSITIVE_PROBES"),
]


@pytest.mark.parametrize("module, name", KINDS)
def test_every_named_component_kind_is_a_registry_with_entries(module, name):
    import keelrl.algos  # noqa: F401  (fills the algorithm registries)

    registry = getattr(importlib.import_module(module), name)
    assert isinstance(registry, Registry)
    assert len(registry) >= 2
    assert all(entry.summary for entry in registry.entries())


def test_the_answer_probes_are_a_registry():
    pytest.importorskip("reasoning_gym")
    from keelrl.audit.reasoning_gym import ANSWER_PROBES

    assert isinstance(ANSWER_PROBES, Registry) and len(ANSWER_PROBES) >= 2


def test_the_registry_module_imports_only_keelrl_errors():
    """It is on the bottom floor: every other layer may import it."""
    tree = ast.parse((REPO / "keelrl" / "registry.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert {module for module in imported if module and module.startswith("keelrl")} == {"keelrl.errors"}


def test_the_critics_and_alarms_are_named_by_their_registries():
    from keelrl.alarms import ALARMS
    from keelrl.policy.critic import CRITICS, build_critic

    assert CRITICS.names() == ["head", "separate", "success_token"]
    assert ALARMS.names() == ["divergence", "entropy_collapse", "zero_advantage", "importance_weight",
                              "patch_collapse"]
    with pytest.raises(UnknownNameError, match="unknown critic 'linear'; valid names: head, separate, success_token"):
        build_critic("linear", None, None, model_path="", device=None, stop_gradient=True)  # type: ignore[arg-type]
