import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cli import env  # noqa: E402

env.apply(os.environ.get("RSTAR2_HOME") or str(ROOT / ".rstar2"))
