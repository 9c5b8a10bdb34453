"""The four modes side by side; see reflow.benchmarks.modes.

    python bench/modes.py --out bench/out/modes
"""

import sys

from reflow.benchmarks.modes import main

if __name__ == "__main__":
    sys.exit(main())
