"""tests/launch: its helper module (launch_trinity_configs) is importable by name."""

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))
