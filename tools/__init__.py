"""Maintainer tools that need the checkout (not installed): mutation testing (Python and C), sanitizer
campaigns, planted-bug timing, the type check. Run each from the checkout's top: ``python -m tools.NAME``."""
