"""Flower stays optional: bayesfuse imports without it, and the integration says how to get it."""

import subprocess
import sys

BLOCK_FLWR = "import sys; sys.modules['flwr'] = None; "


def test_bayesfuse_imports_without_flwr():
    code = BLOCK_FLWR + "import bayesfuse, bayesfuse.fusion, bayesfuse.federated, bayesfuse.cli; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_integration_without_flwr_names_the_extra():
    code = BLOCK_FLWR + "import bayesfuse.integrations.flower"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0 and "pip install 'bayesfuse[flower]'" in out.stderr
