"""`python -m batchgen.cli`: the `batchgen` command."""
import sys

from batchgen.cli import main

sys.exit(main())
