"""The cache machine in parts (``fuzz/cache_machine.py`` assembles it): its state and setup (``base``), the slot
ledger, the oracle, the checks, the API's operations and the tree-shaping rules."""
