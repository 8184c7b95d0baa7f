"""The manager machine in parts (``fuzz/manager_machine.py`` assembles it)."""
