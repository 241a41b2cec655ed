"""The package version: what the ceilings and tuning caches key on (import this, never the package root)."""

__version__ = "0.1.0"
