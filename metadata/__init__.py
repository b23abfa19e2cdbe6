"""Contracts shared by the driver and the workers: config, wire structs, attention metadata."""
