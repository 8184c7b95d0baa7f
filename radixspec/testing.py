"""radixspec's machines for a user's own cache, in the user's own pytest (see ``radixspec.fuzz.testing``).

from radixspec.testing import cache_machine
TestMyCache = cache_machine(lambda page_size, num_pages: MyCache(page_size, num_pages)).TestCase
"""

from radixspec.fuzz.targets.api import EXACT, Profile
from radixspec.fuzz.testing import NothingChecked, Options, cache_machine, hybrid_machine, manager_machine, options

__all__ = [
    "EXACT",
    "NothingChecked",
    "Options",
    "Profile",
    "cache_machine",
    "hybrid_machine",
    "manager_machine",
    "options",
]
