"""``python -m fuzz``: a differential fuzz campaign (see ``fuzz.campaign``)."""

import sys

from .campaign import main

sys.exit(main())
