import os

import torch
from hypothesis import settings

# Deterministic examples under CI (CI=true), fresh ones on a developer's machine.
settings.register_profile("keel", deadline=None, derandomize=os.environ.get("CI") == "true")
settings.load_profile("keel")

torch.set_num_threads(min(2, torch.get_num_threads()))


def available_devices() -> list[str]:
    """CPU always; CUDA as well where a GPU is present, so the GPU path runs wherever it can."""
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
