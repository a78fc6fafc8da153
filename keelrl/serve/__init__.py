"""The endpoint: keelrl's policy behind an OpenAI-compatible API that records every call token for token.

- `keelrl.serve.render`: messages and tools to the policy's tokens (token in, token out), completions back.
- `keelrl.serve.sessions`: calls grouped into episodes, episodes into training samples.
- `keelrl.serve.service`: the decode loop (continuous batching over every session's calls).
- `keelrl.serve.app`: the HTTP routes (`keel serve`, `Endpoint` as a context manager).
- `keelrl.serve.engine`: `rollout.engine=endpoint`, training from a harness's calls.
"""

from keelrl.serve.app import Endpoint, EndpointConfig

__all__ = ["Endpoint", "EndpointConfig"]
