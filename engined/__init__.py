"""engined: a GPU-free stand-in for a vLLM inference engine."""

import os as _os

from engined.core import COMPILED_MODULES as _COMPILED_MODULES
from engined.core import core_build as _core_build

# First, before any compiled module (engined.wire.convert among them) is imported: may the
# compiled core's extension modules load (engined/core/core_build.py)?
_core_build.activate(_COMPILED_MODULES, _os.environ)

__version__ = "0.1.0"
