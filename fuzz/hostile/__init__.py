"""The hostile-input machine in parts (``fuzz/hostile_machine.py`` assembles it)."""
