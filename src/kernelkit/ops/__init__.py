"""The kernel zoo: one module per op family, each registering itself in `registry`."""
