"""``python -m radixspec``: the ``radixspec`` console script (``radixspec --help``)."""

import sys

from radixspec.fuzz.commands import main

sys.exit(main())
