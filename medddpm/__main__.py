"""`python -m medddpm`: the command line (`medddpm.cli.main`)."""

import sys

from medddpm.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
