"""``radixspec fuzz``: a differential fuzz campaign (see ``radixspec.fuzz.campaign``)."""

import sys

from .campaign import main

sys.exit(main())
