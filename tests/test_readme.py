"""README.md's quick start runs as written, and the test command it gives is the one CI runs."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_quick_start_runs_as_written(tmp_path):
    section = README.split("## Quick start", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[:5]] == [f"step {i}" for i in range(5)]
    bytes_per_param = float(re.search(r"optimizer state: ([0-9.]+) bytes", out.stdout).group(1))
    assert 2.0 < bytes_per_param < 2.2, out.stdout  # not 0.0: the state exists after the first step


def test_readme_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci.startswith("python -m pytest") and ci in README
    assert len(README.encode()) <= 15_000
