"""The rollout engines by name (`rollout.engine`), and `build_engine`, which makes the one a config names.

Every engine is driven through the contract of keelrl.rollout.engines; an engine registered
here is a builder taking the config's rollout section, the request stream and the parts an
engine may need (the learner's model, or its path for engines with their own processes).
"""

from __future__ import annotations

from typing import Any, Callable

from keelrl.inference import DecoderOptions, SamplingParams
from keelrl.registry import Registry
from keelrl.rollout.engines import LocalEngine, RequestsFor, RolloutEngine
from keelrl.rollout.scheduler import EpisodeLimits

EngineBuilder = Callable[..., RolloutEngine]

ENGINES: Registry[EngineBuilder] = Registry("rollout engine")
"""rollout.engine's names -> builders taking (settings, requests_for, model, model_path, tokenizer,
make_env, sampling, decoder_options, rollout, seed)."""


@ENGINES.register("sync", summary="the learner's own weights run each step's requests when it asks; nothing overlaps")
def _sync(settings: Any, requests_for: RequestsFor, **parts: Any) -> RolloutEngine:
    return LocalEngine(requests_for, model=parts["model"], tokenizer=parts["tokenizer"], make_env=parts["make_env"],
                       sampling=parts["sampling"], decoder_options=parts["decoder_options"], rollout=parts["rollout"],
                       asynchronous=False)


@ENGINES.register("async", summary="a rollout thread with its own copy of the policy generates while the learner updates")
def _async(settings: Any, requests_for: RequestsFor, **parts: Any) -> RolloutEngine:
    return LocalEngine(requests_for, model=parts["model"], tokenizer=parts["tokenizer"], make_env=parts["make_env"],
                       sampling=parts["sampling"], decoder_options=parts["decoder_options"], rollout=parts["rollout"],
                       asynchronous=True, max_staleness=settings.max_staleness)


@ENGINES.register("ray", summary="rollout workers as Ray actors, each with its own copy of the policy")
def _ray(settings: Any, requests_for: RequestsFor, **parts: Any) -> RolloutEngine:
    from keelrl.rollout.ray_engine import RayEngine

    return RayEngine(requests_for, model_path=parts["model_path"], tokenizer=parts["tokenizer"],
                     make_env=parts["make_env"], sampling=parts["sampling"], decoder_options=parts["decoder_options"],
                     rollout=parts["rollout"], max_staleness=settings.max_staleness, workers=settings.workers,
                     worker_cpus=settings.worker_cpus,
                     worker_cores=tuple(settings.worker_cores), worker_timeout_s=settings.worker_timeout_s,
                     seed=parts["seed"])


def build_engine(settings: Any, requests_for: RequestsFor, *, model: Any, model_path: str, tokenizer: Any,
                 make_env: Callable[[], Any], sampling: SamplingParams, rollout: EpisodeLimits,
                 seed: int, decoder_options: DecoderOptions = DecoderOptions()) -> RolloutEngine:
    """The engine `settings.engine` names (the config's rollout section), over `model` (or, for
    engines with their own processes, the model at `model_path`)."""
    return ENGINES.get(settings.engine)(settings, requests_for, model=model, model_path=model_path,
                                        tokenizer=tokenizer, make_env=make_env, sampling=sampling,
                                        decoder_options=decoder_options, rollout=rollout, seed=seed)
