"""The package type-checks cleanly (STYLE.md, habit 12). `.ci/run` runs this check itself, before
the tests, beside the import layers and the lint rules; here it is marked slow (a minute or two
of a 2-core machine)."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_mypy_is_clean_on_the_whole_package(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"),
         "keelrl"],
        capture_output=True, text=True, cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success" in result.stdout
