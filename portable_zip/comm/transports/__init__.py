"""Transports: one interface (base.Transport), three implementations."""
