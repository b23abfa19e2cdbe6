"""Model definitions and checkpoint loading."""
