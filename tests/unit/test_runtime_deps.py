"""Workers and the coordinator run on users' PCs without torch or transformers (docs/design.md)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

BLOCK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'transformers', 'optimum', 'nncf', 'accelerate'):
            raise ImportError('blocked for this test: ' + name)
sys.meta_path.insert(0, Block())
import worker.cli, worker.server, worker.runner, worker.announce
import coordinator.cli, coordinator.api.app, coordinator.engine.engine, coordinator.chat.client
import coordinator.fleet.registry
print('ok')
"""


def test_roles_import_without_torch():
    out = subprocess.run([sys.executable, "-c", BLOCK], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
