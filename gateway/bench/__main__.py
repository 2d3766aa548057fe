"""``python -m gateway.bench`` is ``quicserve bench`` (the client processes of ``--processes`` run so)."""

import sys

from .cli import main

sys.exit(main())
