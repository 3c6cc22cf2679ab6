"""Entry point of ``python -m db`` (see ``db.cli``)."""

import sys

from db.cli import main

sys.exit(main())
