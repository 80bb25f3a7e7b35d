"""The transformers the Qwen3-Omni tests need: `OMNI_TRANSFORMERS` (`model/qwen3_omni/config.py`).

Below it samebits refuses the thinker at construction (`tests/test_omni_transformers.py` checks
that), so the tests that build one skip there, with this reason. The condition reads the
installed version itself, not samebits' check: a check that refused everything, or nothing,
would fail those tests instead of skipping them.
"""

from __future__ import annotations

import pytest
import transformers
from packaging.version import Version

from samebits.model.qwen3_omni.config import OMNI_TRANSFORMERS

OMNI_RUNS = Version(transformers.__version__) >= Version(OMNI_TRANSFORMERS)
REASON = f"Qwen3-Omni needs transformers>={OMNI_TRANSFORMERS}; this is {transformers.__version__}"

needs_omni_transformers = pytest.mark.skipif(not OMNI_RUNS, reason=REASON)


def skip_module_without_omni_transformers() -> None:
    """For a module that builds Omni inputs at import (its parametrize lists)."""
    if not OMNI_RUNS:
        pytest.skip(REASON, allow_module_level=True)
