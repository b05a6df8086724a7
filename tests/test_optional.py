"""Integrations stay optional: accumnorm imports without them, and each says which extra installs its framework."""
import importlib
import re
import subprocess
import sys

import pytest

from helpers import cpu_env

INTEGRATIONS = {"lightning": "accumnorm.integrations.lightning", "accelerate": "accumnorm.integrations.accelerate",
                "transformers": "accumnorm.integrations.transformers", "mmengine": "accumnorm.integrations.mmengine"}


@pytest.mark.realtime
def test_importing_accumnorm_imports_no_framework():
    code = f"import sys, accumnorm, accumnorm.integrations; print(sorted({set(INTEGRATIONS)!r} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], env=cpu_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize("framework", INTEGRATIONS)
def test_a_missing_framework_names_the_extra_to_install(monkeypatch, framework):
    for name in [n for n in sys.modules if n == framework or n.startswith(framework + ".")] + [framework]:
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules: `import name` raises ImportError
    monkeypatch.delitem(sys.modules, INTEGRATIONS[framework], raising=False)
    with pytest.raises(ImportError, match=re.escape(f"pip install 'accumnorm[{framework}]'")):
        importlib.import_module(INTEGRATIONS[framework])
