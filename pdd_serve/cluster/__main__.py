"""`python -m pdd_serve.cluster ...`, the same as `pdd cluster ...` (a node without the `pdd` script)."""

import sys

from pdd_serve.cluster.cli import main

sys.exit(main())
