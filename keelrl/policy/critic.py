"""Critics: V(history) for critic presets (PPO + GAE), in three placements.

- head:          a linear value head on the policy's last hidden state; with stop_gradient
                 the value loss does not update the policy body (the policy loss still does).
- separate:      a separate model (same architecture and starting weights as the policy)
                 with its own value head: no interference with the policy, twice the compute.
- success_token: the policy's own LM head read as a success predictor: V = P(yes) among the
                 two tokens "Y" and "N" at each position. No new parameters; the value loss
                 trains the shared body and the two tokens' output rows.

Every critic maps (input_ids, attention_mask, policy_hidden) to values [B, T] aligned with
`token_logprobs`: values[:, t] estimates success from the history before token t. Each placement
is a builder registered in `CRITICS` under its `model.critic` name, all with one signature:
builder(policy, tokenizer, *, model_path, device, stop_gradient) -> nn.Module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from keelrl.config import LoraSettings
from keelrl.policy.model import ValueHead, token_logprobs
from keelrl.registry import Registry

CRITICS: Registry[Callable[..., nn.Module]] = Registry(
    "critic", ("policy", "tokenizer", "model_path", "device", "stop_gradient"))
"""`model.critic` name -> builder of that critic (see the module docstring), in registration order."""


def _shift(values: Tensor) -> Tensor:
    """Values computed at position t-1 describe the history before token t."""
    return torch.cat([values[:, :1], values[:, :-1]], dim=1)


class HeadCritic(nn.Module):
    def __init__(self, hidden_size: int, stop_gradient: bool) -> None:
        super().__init__()
        self.head = ValueHead(hidden_size, stop_gradient)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, policy_hidden: Tensor) -> Tensor:
        return self.head(policy_hidden)


class SeparateCritic(nn.Module):
    def __init__(self, body: Any) -> None:
        super().__init__()
        self.body = body
        self.head = ValueHead(body.config.hidden_size, stop_gradient=False)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, policy_hidden: Tensor) -> Tensor:
        hidden = token_logprobs(self.body, input_ids, attention_mask, with_hidden=True)["hidden"]
        return self.head(hidden)


class SuccessTokenCritic(nn.Module):
    def __init__(self, policy: Any, yes_id: int, no_id: int) -> None:
        super().__init__()
        self._policy = [policy]  # not a submodule: its parameters belong to the policy
        self.yes_id, self.no_id = yes_id, no_id

    def forward(self, input_ids: Tensor, attention_mask: Tensor, policy_hidden: Tensor) -> Tensor:
        head = self._policy[0].get_output_embeddings()
        rows = head.weight[[self.yes_id, self.no_id]]  # [2, H]
        logits = policy_hidden.float() @ rows.float().T  # [B, T, 2]
        if head.bias is not None:
            logits = logits + head.bias[[self.yes_id, self.no_id]].float()
        return _shift(torch.softmax(logits, dim=-1)[..., 0])


@CRITICS.register("head", summary="a linear value head on the policy's last hidden state")
def _head_critic(policy: Any, tokenizer: Any, *, model_path: str, device: torch.device,
                 stop_gradient: bool) -> nn.Module:
    return HeadCritic(policy.config.hidden_size, stop_gradient).to(device)


@CRITICS.register("separate", summary="a separate model, started from the policy's weights, with its own value head")
def _separate_critic(policy: Any, tokenizer: Any, *, model_path: str, device: torch.device,
                     stop_gradient: bool) -> nn.Module:
    from keelrl.policy import lora
    from keelrl.policy.model import load_policy

    body, _ = load_policy(model_path, device)
    if lora.is_lora(body):  # model_path holds an adapter: the critic starts from the policy's merged weights
        body = lora.merged_model(body)
    body.load_state_dict(lora.merged_state_dict(policy))
    if lora.is_lora(policy):  # a LoRA policy's critic trains an adapter of the same settings, its base frozen
        body = lora.apply_lora(body, LoraSettings(**lora.adapter_settings(policy)), base=model_path)
    return SeparateCritic(body).to(device)


@CRITICS.register("success_token", summary="the policy's LM head read as P(yes) between the tokens Y and N")
def _success_token_critic(policy: Any, tokenizer: Any, *, model_path: str, device: torch.device,
                          stop_gradient: bool) -> nn.Module:
    yes_id, no_id = (tokenizer(text, add_special_tokens=False)["input_ids"][0] for text in ("Y", "N"))
    return SuccessTokenCritic(policy, yes_id, no_id)


def build_critic(kind: str, policy: Any, tokenizer: Any, *, model_path: str, device: torch.device,
                 stop_gradient: bool) -> nn.Module:
    """The critic `kind` (a name in CRITICS) for `policy`; UnknownNameError listing the valid names otherwise."""
    return CRITICS[kind](policy, tokenizer, model_path=model_path, device=device, stop_gradient=stop_gradient)
