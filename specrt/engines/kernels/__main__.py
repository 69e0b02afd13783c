"""`python -m specrt.engines.kernels`: build the kernel library (build.py; make setup runs it)."""

import sys

from specrt.engines.kernels.build import main

sys.exit(main())
