"""The README as a newcomer reads it: its first two commands are CI's, its quickstart runs as written, it is short."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import cpu_env

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


@pytest.mark.realtime
def test_the_quickstart_runs_as_a_script_and_matches_the_whole_batch(tmp_path):
    """The first python block that calls accumnorm.backward, as it stands in the README, in a fresh interpreter."""
    script = next(block for block in re.findall(r"```python\n(.*?)```", README, re.S) if "accumnorm.backward" in block)
    (tmp_path / "quickstart.py").write_text(script)
    proc = subprocess.run([sys.executable, "quickstart.py"], cwd=tmp_path, env=cpu_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    found = re.search(r"gradients (\S+), running mean (\S+)", proc.stdout)
    assert found and float(found.group(1)) < 1e-5 and float(found.group(2)) < 1e-5, proc.stdout


def test_the_first_two_commands_run_the_demo_and_what_ci_runs():
    first, second = re.search(r"```bash\n(.*?)```", README, re.S).group(1).splitlines()[:2]
    assert re.match(r'python -m pip install -e "\.\[all\]" && accumnorm study --quick\s', first), first
    ci = (ROOT / ".ci" / "run").read_text()
    install, tests = (part.split("#")[0].strip() for part in second.split("&&"))
    assert (install, tests) == ('python -m pip install -e ".[dev]"', "python -m pytest -q -n auto"), second
    assert f"\n{install} || exit 1\n{tests}\n" in ci


def test_the_readme_is_a_front_door_of_at_most_about_200_lines():
    assert len(README.splitlines()) <= 210
    for page in ("how-it-works.md", "layers.md", "trainer.md", "integrations.md", "study/README.md", "api.md",
                 "development.md"):
        assert f"](docs/{page})" in README and (ROOT / "docs" / page).is_file(), page
