"""``python -m batchgen``: the ``batchgen`` command."""
from batchgen.cli import main

raise SystemExit(main())
