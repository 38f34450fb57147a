from __future__ import annotations

import os
import sys
from pathlib import Path

# librosa's numba functions compile on first use (~20 s of the audio comparison test); a cache
# outside the clone keeps the compiled code for the next run of the suite on this machine
os.environ.setdefault("NUMBA_CACHE_DIR", str(Path.home() / ".cache" / "aisp-numba"))

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "src"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
