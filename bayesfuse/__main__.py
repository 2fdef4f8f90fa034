"""``python -m bayesfuse``: the command line (:mod:`bayesfuse.cli`)."""

import sys

from bayesfuse.cli import main

if __name__ == "__main__":
    sys.exit(main())
