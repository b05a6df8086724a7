"""benchmarks/bench_backward.py as a command: --compile adds the compile table, every compiled method timed."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import cpu_env

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "bench_backward.py"


@pytest.mark.slow
def test_compile_adds_a_table_of_the_compiled_methods_over_compiled_plain_and_the_floor():
    args = ["--compile", "aot_eager", "--models", "study", "--ks", "4", "--rounds", "1", "--threads", "1",
            "--schedules", "layerwise", "--no-memory", "--size", "16"]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], env=cpu_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "failed" not in proc.stdout, proc.stdout + proc.stderr[-3000:]
    compiled = proc.stdout.split("Compiled with torch.compile(backend='aot_eager')")[1].splitlines()
    at = next(i for i, line in enumerate(compiled) if line.startswith("model"))
    header, row = compiled[at].split(), compiled[at + 1].split()
    assert header[5:] == ["c.plain", "ms", "1t", "c.plain/plain", "1t", "c.floor", "1t", "c.layerwise", "1t",
                          "layerwise", "1t", "c.layerwise/floor", "1t", "c.plain", "1st", "s", "1t", "c.layerwise",
                          "1st", "s", "1t"]
    assert row[:3] == ["study", "4", "4x8"] and re.fullmatch(r"\d+", row[3])
    assert all(re.fullmatch(r"\d+\.\d\dx", cell) for cell in row[4:9]), row  # ratios, each method timed
    assert all(re.fullmatch(r"\d+\.\d", cell) for cell in row[9:]), row  # the first steps' seconds
