"""LoRA adapters on the policy, through peft (`model.lora`).

With `model.lora.rank` > 0 the Trainer wraps its policy in a peft LoRA adapter (`apply_lora`:
peft's `get_peft_model`). peft injects the adapter layers into the transformers model itself, so
the policy stays that model (`model.model` is its body, `generate` and every pass run with the
adapter on); the peft wrapper is kept beside it (`peft_model`) for saving and switching the
adapter off. The base weights are frozen: only the adapters (and a critic's own weights) train,
and the optimizer holds only those (`trainable_parameters`).

- `merged_state_dict(model)`: the weights under the base model's names
  (`model.layers.0.self_attn.q_proj.weight`: no `base_model.model.` prefix, no `base_layer`),
  each adapter folded in (W + scaling x B A), computed without touching the model: what decoders
  and rollout copies read (keelrl.inference.weights). A model without adapters gives its own
  state dict.
- `adapter_state_dict(model)`: the adapter's weights alone (peft's `get_peft_model_state_dict`).
- `save_adapter` / `load_adapter_weights`: a checkpoint's model/ folder holds the adapter alone,
  as peft writes it (adapter_model.safetensors and adapter_config.json, whose
  base_model_name_or_path names the base: a registered name or an absolute directory), beside
  the tokenizer. Such a folder is a model.path of its own: `keelrl.policy.model.load_policy`
  loads the base it names and the adapter on it (`load_adapter`), and peft's
  `AutoPeftModelForCausalLM.from_pretrained` reads it too.
- `AdapterReference`: the KL reference of a LoRA run, with no second model in memory: the policy
  as RL started, which is the base with the adapter off (peft's `disable_adapter`) when the
  adapter was still zero then, else (a warm start trained it) the base with a frozen copy of the
  adapter as it was, swapped in for the reference's passes.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import Tensor, nn

from keelrl.errors import ConfigError

if TYPE_CHECKING:
    from keelrl.config import LoraSettings

ADAPTER_CONFIG = "adapter_config.json"
"""The file that marks a folder as a (peft) adapter: its settings and the base it goes on."""
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER = "default"
"""The name of keelrl's one adapter in peft's model."""
_PEFT = "_keel_peft"
"""The attribute of a transformers model that holds the peft wrapper around it (set without
registering it as a submodule: it contains the model)."""
_PREFIX = "lora_"
"""What peft's LoRA parameter names contain (lora_A, lora_B, ...), as peft itself tells them apart."""


def _peft_loaded() -> bool:
    """Whether peft is imported: no model has a LoRA layer before it is (and plain runs never import it)."""
    return "peft" in sys.modules


def unwrap(model: Any) -> Any:
    """The transformers model under a peft wrapper (the model itself when there is none)."""
    if _peft_loaded():
        from peft import PeftModel

        if isinstance(model, PeftModel):
            return model.get_base_model()
    return model


def lora_layers(model: Any) -> dict[str, Any]:
    """{module name: LoRA layer} of `model` (a peft wrapper's: under the base model's names)."""
    if not _peft_loaded():
        return {}
    from peft.tuners.lora import LoraLayer

    return {name: module for name, module in unwrap(model).named_modules() if isinstance(module, LoraLayer)}


def is_lora(model: Any) -> bool:
    """Whether `model` (a transformers model or its peft wrapper) has LoRA layers."""
    return bool(lora_layers(model))


def peft_model(model: Any) -> Any:
    """The peft wrapper of `model` (`model` itself when it is one); ValueError for a model that has none."""
    if _peft_loaded():
        from peft import PeftModel

        if isinstance(model, PeftModel):
            return model
    wrapper = getattr(model, "__dict__", {}).get(_PEFT)
    if wrapper is None:
        raise ValueError(f"{type(model).__name__} has no LoRA adapter (model.lora.rank=0?)")
    return wrapper


def _keep_wrapper(wrapper: Any) -> Any:
    """The transformers model inside `wrapper`, remembering the wrapper (see `_PEFT`)."""
    inner = wrapper.get_base_model()
    object.__setattr__(inner, _PEFT, wrapper)  # not a submodule: the wrapper holds `inner`
    return inner


def linear_module_names(model: Any) -> list[str]:
    """The distinct last names of `model`'s linear layers (q_proj, ..., lm_head), sorted: what
    model.lora.target_modules may name."""
    from transformers.pytorch_utils import Conv1D

    return sorted({name.rsplit(".", 1)[-1] for name, module in unwrap(model).named_modules()
                   if isinstance(module, (nn.Linear, Conv1D)) and name})


def check_targets(model: Any, targets: list[str]) -> None:
    """ConfigError naming model.lora.target_modules unless each target names a linear layer of
    `model` (as peft matches them: the module's name, or a dotted tail of it)."""
    from transformers.pytorch_utils import Conv1D

    linear = [name for name, module in unwrap(model).named_modules() if isinstance(module, (nn.Linear, Conv1D))]
    for target in targets:
        if not any(name == target or name.endswith(f".{target}") for name in linear):
            raise ConfigError("model.lora.target_modules", f"{type(unwrap(model)).__name__} has no linear layer named "
                                                           f"{target!r}; its linear layers are: "
                                                           f"{', '.join(linear_module_names(model))}")


def apply_lora(model: Any, settings: LoraSettings, base: str) -> Any:
    """`model` (a transformers causal LM) with a fresh LoRA adapter of `settings` on its target
    layers (peft's `get_peft_model`): the same model object, its base frozen, the adapter
    trainable. `base`: how the saved adapter names its base model (adapter_config.json)."""
    from peft import LoraConfig, get_peft_model

    if settings.rank <= 0:
        raise ValueError(f"apply_lora needs model.lora.rank > 0, got {settings.rank}")
    if is_lora(model):
        raise ValueError(f"{type(unwrap(model)).__name__} has a LoRA adapter already")
    check_targets(model, list(settings.target_modules))
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha,  # type: ignore[arg-type]  # alpha / r: any number
                        lora_dropout=settings.dropout,
                        target_modules=list(settings.target_modules), bias="none", task_type="CAUSAL_LM")
    wrapper = get_peft_model(model, config, adapter_name=ADAPTER)
    wrapper.peft_config[ADAPTER].base_model_name_or_path = base  # get_peft_model sets the path the model loaded from
    return _keep_wrapper(wrapper)


def adapter_settings(model: Any) -> dict[str, Any]:
    """The LoRA settings of `model`'s adapter as model.lora spells them (rank, alpha, target_modules, dropout)."""
    config = peft_model(model).peft_config[ADAPTER]
    targets = config.target_modules
    return {"rank": config.r, "alpha": float(config.lora_alpha),
            "target_modules": sorted(targets) if isinstance(targets, (set, list, tuple)) else targets,
            "dropout": float(config.lora_dropout)}


def check_settings(model: Any, settings: LoraSettings, where: str) -> None:
    """ConfigError naming the first model.lora field whose value differs from `model`'s adapter
    (loaded from `where`, a model.path holding an adapter, which trains on as it is)."""
    have = adapter_settings(model)
    want = {"rank": settings.rank, "alpha": float(settings.alpha), "target_modules": sorted(settings.target_modules),
            "dropout": float(settings.dropout)}
    for name, value in want.items():
        if have[name] != value:
            raise ConfigError(f"model.lora.{name}", f"model.path {where!r} holds an adapter with {name}={have[name]!r}, "
                                                    f"which trains on as it is: set model.lora.{name} to that (or "
                                                    f"model.lora.rank=0 to merge the adapter and train the whole model), "
                                                    f"got {value!r}")


def settle(model: Any, settings: LoraSettings, base: str, path: str) -> Any:
    """The policy a run with `settings` (model.lora) trains from the loaded `model` (model.path `path`):

    rank > 0: a fresh adapter on a plain model (`apply_lora`), or the adapter a LoRA model came
    with (a model.path holding an adapter), trained on if its settings are `settings`;
    rank 0: a plain model as it is, or a LoRA model's adapter merged into its base (the whole
    model trains)."""
    if settings.rank > 0:
        if not is_lora(model):
            return apply_lora(model, settings, base)
        check_settings(model, settings, path)
        for name, parameter in unwrap(model).named_parameters():
            parameter.requires_grad_(_PREFIX in name)
        return model
    if is_lora(model):
        return merged_model(model)
    return model


def merged_model(model: Any) -> Any:
    """`model`'s adapter merged into its base for good (peft's `merge_and_unload`): a plain
    transformers model, every weight trainable. The model is changed: use `merged_copy` to keep it."""
    plain = peft_model(model).merge_and_unload()
    plain.__dict__.pop(_PEFT, None)
    plain.__dict__.pop("peft_config", None)
    return plain.requires_grad_(True)


def merged_copy(model: Any) -> Any:
    """A plain copy of `model` with its adapters folded in (`model` unchanged): a rollout side's
    own policy, which the merged state dicts of later publishes load into. A model without
    adapters is deep-copied as it is."""
    import copy

    own = copy.deepcopy(model)
    return merged_model(own) if is_lora(own) else own


def _base_names(model: Any) -> dict[str, str]:
    """{state-dict name of a LoRA model: its name in the base model} for the base's entries (the
    adapters' own entries are left out): `...q_proj.base_layer.weight` -> `...q_proj.weight`."""
    inner = unwrap(model)
    layers = lora_layers(inner)
    names: dict[str, str] = {}
    for key in inner.state_dict():
        owner = next((name for name in _owners(key) if name in layers), None)
        if owner is None:
            names[key] = key
            continue
        rest = key[len(owner) + 1:]
        if rest.startswith("base_layer."):
            names[key] = f"{owner}.{rest.removeprefix('base_layer.')}"
    return names


def _owners(key: str) -> Iterator[str]:
    """The module names a state-dict key lies under, innermost first (a.b.c.weight: a.b.c, a.b, a)."""
    parts = key.split(".")[:-1]
    for end in range(len(parts), 0, -1):
        yield ".".join(parts[:end])


@torch.no_grad()
def merged_state_dict(model: Any) -> dict[str, Tensor]:
    """`model`'s weights under the base model's names, each active adapter folded in.

    For a LoRA model (a transformers model with peft's layers, or its peft wrapper): the base's
    state dict names, W + scaling x B A for each adapted weight (a new tensor in W's dtype,
    summed in float32 at least), the other tensors the model's own (as state_dict gives them).
    Nothing in the model changes (no merge). Adapters switched off, or merged already, add
    nothing. For a plain model: its state dict."""
    inner = unwrap(model)
    layers = lora_layers(inner)
    if not layers:
        return dict(inner.state_dict())
    source = inner.state_dict()
    state = {base_name: source[key] for key, base_name in _base_names(inner).items()}
    for name, layer in layers.items():
        if layer.disable_adapters:
            continue
        weight_name = f"{name}.weight"
        weight = state[weight_name]
        total = weight.to(torch.promote_types(weight.dtype, torch.float32))
        changed = False
        for adapter in layer.active_adapters:
            if adapter in layer.merged_adapters or adapter not in layer.scaling:
                continue  # merged: in the base weight already; not an adapter of this layer
            total = total + layer.get_delta_weight(adapter).to(total.dtype)
            changed = True
        if changed:
            state[weight_name] = total.to(weight.dtype)
    return state


def adapter_state_dict(model: Any) -> dict[str, Tensor]:
    """The adapter's weights alone, under the names peft saves them by (peft's `get_peft_model_state_dict`)."""
    from peft import get_peft_model_state_dict

    # save_embedding_layers=False: no embedding trains beside the adapter, and peft's "auto" would look the base's
    # name up on the Hugging Face Hub (a registered name such as smollm2 is not a Hub repository)
    return get_peft_model_state_dict(peft_model(model), adapter_name=ADAPTER, save_embedding_layers=False)


def adapter_parameters(model: Any) -> dict[str, nn.Parameter]:
    """{name: parameter} of `model`'s adapters (all of them, trainable or not), under the model's names."""
    return {name: parameter for name, parameter in unwrap(model).named_parameters() if _PREFIX in name}


def trainable_parameters(module: Any) -> list[nn.Parameter]:
    """`module`'s parameters that train (requires_grad): a LoRA model's adapters, every parameter
    of a plain one. What optimizers are given."""
    return [parameter for parameter in module.parameters() if parameter.requires_grad]


def trainable_state_dict(module: nn.Module) -> dict[str, Tensor]:
    """The entries of `module.state_dict()` that are trainable parameters, and its buffers: what a
    LoRA run's checkpoint keeps of a part (a critic) with a frozen base in it."""
    frozen = _frozen_names(module)
    return {name: tensor for name, tensor in module.state_dict().items() if name not in frozen}


def _frozen_names(module: nn.Module) -> set[str]:
    """The names of `module`'s parameters that do not train, tied ones under each name (lm_head.weight too)."""
    return {name for name, parameter in module.named_parameters(remove_duplicate=False)
            if not parameter.requires_grad}


def load_trainable_state_dict(module: nn.Module, state: dict[str, Tensor]) -> None:
    """Load `trainable_state_dict`'s entries into `module`; ValueError when one of its trainable
    parameters or buffers is missing, or an entry is not `module`'s."""
    frozen = _frozen_names(module)
    result = module.load_state_dict(state, strict=False)
    missing = [name for name in result.missing_keys if name not in frozen]
    if missing or result.unexpected_keys:
        raise ValueError(f"{type(module).__name__}: the saved state lacks {missing[:4]} and has unexpected "
                         f"{list(result.unexpected_keys)[:4]}")


def adapter_is_zero(model: Any) -> bool:
    """Whether every adapter of `model` adds nothing (each B is zero, as peft starts them)."""
    return all(not bool(parameter.detach().any()) for name, parameter in adapter_parameters(model).items()
               if ".lora_B." in name or ".lora_embedding_B." in name)


# ----------------------------------------------------------------- saving and loading


def is_adapter_dir(path: str | Path) -> bool:
    """Whether `path` is a folder holding a peft adapter (adapter_config.json)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_base(directory: str | Path) -> str:
    """The base model an adapter folder names (its adapter_config.json's base_model_name_or_path)."""
    path = Path(directory) / ADAPTER_CONFIG
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: not a readable adapter config ({error})") from None
    base = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    if not isinstance(base, str) or not base:
        raise ValueError(f"{path} names no base model (base_model_name_or_path): the adapter cannot be loaded "
                         f"without one")
    if config.get("peft_type") not in (None, "LORA") or config.get("use_dora"):
        raise ValueError(f"{path}: a {config.get('peft_type')} adapter{' with DoRA' if config.get('use_dora') else ''}; "
                         f"keelrl loads plain LoRA adapters only")
    return base


def save_adapter(model: Any, directory: str | Path) -> None:
    """Write `model`'s adapter into `directory` as peft does (adapter_model.safetensors, adapter_config.json)."""
    peft_model(model).save_pretrained(str(directory), selected_adapters=[ADAPTER], save_embedding_layers=False)


def load_adapter(model: Any, directory: str | Path, trainable: bool = True) -> Any:
    """The plain transformers `model` with the adapter saved in `directory` on it (peft's
    `PeftModel.from_pretrained`): the same model object, its base frozen, the adapter trainable
    unless `trainable` is false."""
    from peft import PeftModel

    adapter_base(directory)  # a readable LoRA config naming its base
    wrapper = PeftModel.from_pretrained(model, str(directory), adapter_name=ADAPTER, is_trainable=trainable)
    return _keep_wrapper(wrapper)


def read_adapter_file(directory: str | Path) -> dict[str, Tensor]:
    """The tensors of the adapter saved in `directory`, under peft's saved names."""
    from safetensors.torch import load_file

    path = Path(directory) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no adapter weights")
    return load_file(str(path))


@torch.no_grad()
def load_adapter_weights(model: Any, directory: str | Path) -> None:
    """Load the adapter saved in `directory` into `model`'s own adapter, in place (the same
    parameter objects: an optimizer over them stays valid). ValueError unless the saved adapter
    has exactly the model's adapter's tensors, of the same shapes."""
    from peft import set_peft_model_state_dict

    saved = read_adapter_file(directory)
    own = adapter_state_dict(model)
    if set(saved) != set(own):
        missing, extra = sorted(set(own) - set(saved)), sorted(set(saved) - set(own))
        raise ValueError(f"{directory}: the saved adapter does not fit the model's: missing {missing[:3]}, "
                         f"extra {extra[:3]} (another model.lora.target_modules?)")
    for name, tensor in saved.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise ValueError(f"{directory}: {name} is {tuple(tensor.shape)} there, {tuple(own[name].shape)} in the "
                             f"model (another model.lora.rank?)")
    result = set_peft_model_state_dict(peft_model(model), saved, adapter_name=ADAPTER)
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise ValueError(f"{directory}: adapter tensors the model has no place for: {unexpected[:3]}")


@torch.no_grad()
def read_adapter(model: Any, directory: str | Path) -> dict[str, Tensor]:
    """The adapter saved in `directory` as {name: tensor} under `model`'s adapter parameter names
    (`adapter_parameters`), `model`'s own adapter left as it was."""
    live = adapter_parameters(model)
    kept = {name: parameter.detach().clone() for name, parameter in live.items()}
    try:
        load_adapter_weights(model, directory)
        return {name: parameter.detach().clone() for name, parameter in live.items()}
    finally:
        for name, parameter in live.items():
            parameter.copy_(kept[name])


# ----------------------------------------------------------------- the reference


@contextlib.contextmanager
def adapter_off(model: Any) -> Iterator[None]:
    """Run `model` as its base: every adapter switched off (peft's `disable_adapter`), in eval mode."""
    inner = unwrap(model)
    training = inner.training
    inner.eval()
    try:
        with peft_model(model).disable_adapter():
            yield
    finally:
        inner.train(training)


@contextlib.contextmanager
def swapped_adapter(model: Any, weights: dict[str, Tensor]) -> Iterator[None]:
    """Run `model` (in eval mode) with its adapter's parameters holding `weights`
    ({name: tensor} as `adapter_parameters` names them), its own put back after."""
    live = adapter_parameters(model)
    if set(weights) != set(live):
        raise ValueError("the weights to swap in are not the model's adapter's")
    inner = unwrap(model)
    training = inner.training
    with torch.no_grad():
        kept = {name: parameter.detach().clone() for name, parameter in live.items()}
        for name, parameter in live.items():
            parameter.copy_(weights[name])
    inner.eval()
    try:
        yield
    finally:
        inner.train(training)
        with torch.no_grad():
            for name, parameter in live.items():
                parameter.copy_(kept[name])


class AdapterReference:
    """The frozen KL reference of a LoRA run, without a second copy of the model.

    It is the policy as RL starts (`freeze`, after the warm start), run by the policy's own model:
    with the adapter switched off when the adapter was zero then (no warm start: the reference is
    the base), else with a frozen copy of the adapter as it was then (adapter-sized) swapped in.
    `active()` is the context the reference's passes run in, through `model`."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.adapter: dict[str, Tensor] | None = None
        """The adapter as RL started; None: it was zero (the base is the reference)."""

    def freeze(self) -> None:
        """The reference is the policy as it is now."""
        self.adapter = None if adapter_is_zero(self.model) else {
            name: parameter.detach().clone() for name, parameter in adapter_parameters(self.model).items()}

    def save(self, directory: Path) -> None:
        """Write the reference's adapter (the policy's now, just frozen) into `directory`."""
        save_adapter(self.model, directory)

    def load(self, directory: Path) -> None:
        """The reference whose adapter `save` wrote into `directory`."""
        weights = read_adapter(self.model, directory)
        zero = all(not bool(tensor.any()) for name, tensor in weights.items()
                   if ".lora_B." in name or ".lora_embedding_B." in name)
        self.adapter = None if zero else weights

    def active(self) -> contextlib.AbstractContextManager[None]:
        """The context in which `model` runs as the reference."""
        return adapter_off(self.model) if self.adapter is None else swapped_adapter(self.model, self.adapter)
