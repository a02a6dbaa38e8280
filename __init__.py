"""attnplug: a pluggable attention-backend framework for LLM inference.

The step's data flow: scheduler output → input batch → prepare inputs → common
metadata → per-group builder → attention impl. See ``docs/architecture.md``.
"""

from attnplug.core import *  # noqa: F401,F403
from attnplug.core import __all__ as _core_all

__version__ = "0.1.0"
__all__ = list(_core_all) + ["__version__"]
