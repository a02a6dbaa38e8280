"""``tests/runner/`` mirrors the package: ``step/``, ``execute/``, ``serve/``, ``models/``,
``commands/`` (the tensor-parallel tests are ``tests/distributed/``).

Some test modules import helpers from others by module name (``from test_parity_hybrid
import BAMBA``), across these folders: every folder is put on ``sys.path`` here, once.
"""

import sys
from pathlib import Path

_HERE = Path(__file__).parent
for _sub in ("step", "execute", "serve", "models", "commands"):
    _p = str(_HERE / _sub)
    if _p not in sys.path:
        sys.path.insert(0, _p)
