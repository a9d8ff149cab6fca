"""``python -m hasten ...``: the same as the ``hasten`` command."""
import sys

from .cli import main

sys.exit(main())
