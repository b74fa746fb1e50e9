"""`python -m fastgen.planning MODEL [--field value ...]`: print the plan (see `cli.py`)."""

import sys

from fastgen.planning.cli import main

sys.exit(main())
