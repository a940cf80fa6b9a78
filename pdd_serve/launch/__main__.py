"""`python -m pdd_serve.launch ...`: check a cluster config against its graph, render its commands."""

import sys

from pdd_serve.launch.cli import main

sys.exit(main())
