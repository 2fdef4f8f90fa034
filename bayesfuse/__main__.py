"""``python -m bayesfuse``: the command line (:mod:`bayesfuse.cli`)."""

import sys

from bayesfuse.cli import main

sys.exit(main())
